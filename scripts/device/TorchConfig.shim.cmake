# Stand-in for a pip LibTorch's TorchConfig.cmake on a machine without a
# CUDA toolkit (no nvcc). The wheel's own config includes
# Caffe2/public/cuda.cmake, which calls find_package(CUDAToolkit) and
# enable_language(CUDA), and fails the whole find_package(Torch) without
# nvcc, although nothing here compiles CUDA code: localsgd only needs the
# headers (ProcessGroupNCCL.hpp includes CUDA's and NCCL's) and the shared
# libraries, which the wheel and its nvidia-* dependencies have.
#
# scripts/device/nccl_check.sh copies this file to <build>/torch-shim/Torch/
# TorchConfig.cmake, links <build>/torch-shim/Caffe2 to the wheel's Caffe2
# directory (tests/node/check_nccl_config.cmake reads Caffe2Targets*.cmake
# next to Torch_DIR) and configures with -DTorch_DIR=<build>/torch-shim/Torch
# -DLOCALSGD_SHIM_TORCH_ROOT=<site-packages>/torch. Used only by that script.
#
# What it does, as the real one does: includes the wheel's
# Caffe2Targets.cmake (the imported torch, torch_cpu, torch_cuda, c10, ...
# targets with their compile definitions such as USE_C10D_NCCL), sets
# TORCH_INCLUDE_DIRS, TORCH_LIBRARIES and TORCH_CXX_FLAGS. Instead of
# cuda.cmake: every namespaced target those targets link (CUDA::cudart,
# torch::cudart, caffe2::..., ...) that the file does not define becomes an
# INTERFACE target carrying the CUDA include directories (and libcudart for
# the cudart ones), found in the wheel's nvidia-* packages or /usr/local/cuda.
cmake_policy(PUSH)
cmake_policy(VERSION 3.18...3.31)

if(NOT LOCALSGD_SHIM_TORCH_ROOT)
  message(FATAL_ERROR "TorchConfig shim: set LOCALSGD_SHIM_TORCH_ROOT to the "
    "torch package directory (python3 -c 'import torch,os; "
    "print(os.path.dirname(torch.__file__))')")
endif()
set(_shim_root "${LOCALSGD_SHIM_TORCH_ROOT}")
set(_shim_caffe2 "${_shim_root}/share/cmake/Caffe2")
if(NOT EXISTS "${_shim_caffe2}/Caffe2Targets.cmake")
  message(FATAL_ERROR "TorchConfig shim: no ${_shim_caffe2}/Caffe2Targets.cmake")
endif()
get_filename_component(_shim_site "${_shim_root}/.." ABSOLUTE)

find_package(Threads REQUIRED)
if(NOT TARGET caffe2::Threads)
  add_library(caffe2::Threads INTERFACE IMPORTED)
  set_property(TARGET caffe2::Threads PROPERTY
    INTERFACE_LINK_LIBRARIES Threads::Threads)
endif()

# CUDA and NCCL headers and the CUDA runtime library.
file(GLOB _shim_cuda_includes LIST_DIRECTORIES true
  "${_shim_site}/nvidia/*/include" "${_shim_site}/nvidia/*/*/include")
list(FILTER _shim_cuda_includes EXCLUDE REGEX "/include/.+")
if(EXISTS /usr/local/cuda/include)
  list(APPEND _shim_cuda_includes /usr/local/cuda/include)
endif()
file(GLOB _shim_cudart
  "${_shim_site}/nvidia/*/lib/libcudart.so*"
  "${_shim_site}/nvidia/*/*/lib/libcudart.so*"
  /usr/local/cuda/lib64/libcudart.so*)
list(SORT _shim_cudart)
list(LENGTH _shim_cudart _n)
set(_shim_cudart_lib "")
if(_n GREATER 0)
  list(GET _shim_cudart 0 _shim_cudart_lib)
endif()
# An imported target, so that CMake links the versioned file by its path.
if(_shim_cudart_lib AND NOT TARGET localsgd_shim::cudart)
  add_library(localsgd_shim::cudart SHARED IMPORTED)
  set_property(TARGET localsgd_shim::cudart PROPERTY
    IMPORTED_LOCATION "${_shim_cudart_lib}")
endif()
message(STATUS "TorchConfig shim: torch ${_shim_root}")
message(STATUS "TorchConfig shim: CUDA/NCCL include dirs: ${_shim_cuda_includes}")
message(STATUS "TorchConfig shim: CUDA runtime: ${_shim_cudart_lib}")

# Namespaced names the wheel's targets link, minus those it defines.
file(GLOB _shim_target_files "${_shim_caffe2}/Caffe2Targets*.cmake")
set(_shim_needed "")
set(_shim_defined "")
foreach(_file ${_shim_target_files})
  file(STRINGS "${_file}" _lines REGEX "INTERFACE_LINK_LIBRARIES|add_library\\(")
  foreach(_line ${_lines})
    string(REGEX MATCHALL "[A-Za-z0-9_.+-]+::[A-Za-z0-9_.+-]+" _names "${_line}")
    if(_line MATCHES "add_library\\(")
      list(APPEND _shim_defined ${_names})
    else()
      list(APPEND _shim_needed ${_names})
    endif()
  endforeach()
endforeach()
list(REMOVE_DUPLICATES _shim_needed)
foreach(_name ${_shim_needed})
  if(TARGET ${_name} OR _name IN_LIST _shim_defined)
    continue()
  endif()
  add_library(${_name} INTERFACE IMPORTED)
  if(_name MATCHES "^(CUDA::|torch::cud|caffe2::cu|torch::nv|caffe2::nv)")
    set_property(TARGET ${_name} PROPERTY
      INTERFACE_INCLUDE_DIRECTORIES "${_shim_cuda_includes}")
  endif()
  if(_name MATCHES "^(CUDA::cudart|torch::cudart)$" AND _shim_cudart_lib)
    set_property(TARGET ${_name} PROPERTY
      INTERFACE_LINK_LIBRARIES localsgd_shim::cudart)
  endif()
  message(STATUS "TorchConfig shim: stand-in target ${_name}")
endforeach()

include("${_shim_caffe2}/Caffe2Targets.cmake")

# Absolute paths of the machine that built the wheel (e.g. a CUDA library
# under /usr/local/cuda) that do not exist here would fail the link.
foreach(_target c10 c10_cuda torch_cpu torch_cuda torch torch_library
    torch_cpu_library torch_cuda_library torch_global_deps)
  if(NOT TARGET ${_target})
    continue()
  endif()
  get_target_property(_links ${_target} INTERFACE_LINK_LIBRARIES)
  if(NOT _links)
    continue()
  endif()
  set(_kept "")
  foreach(_item IN LISTS _links)
    if(_item MATCHES "^/" AND NOT EXISTS "${_item}")
      message(STATUS "TorchConfig shim: ${_target}: dropping missing ${_item}")
      continue()
    endif()
    list(APPEND _kept "${_item}")
  endforeach()
  set_property(TARGET ${_target} PROPERTY INTERFACE_LINK_LIBRARIES "${_kept}")
endforeach()

set(TORCH_INSTALL_PREFIX "${_shim_root}")
set(TORCH_INCLUDE_DIRS
  "${_shim_root}/include"
  "${_shim_root}/include/torch/csrc/api/include")
set(TORCH_LIBRARIES torch)
if(TARGET torch_library)
  list(APPEND TORCH_LIBRARIES torch_library)
endif()
foreach(_lib c10 c10_cuda)
  find_library(_shim_${_lib}_LIBRARY ${_lib} PATHS "${_shim_root}/lib"
    NO_DEFAULT_PATH)
  if(_shim_${_lib}_LIBRARY)
    list(APPEND TORCH_LIBRARIES "${_shim_${_lib}_LIBRARY}")
  endif()
endforeach()
if(_shim_cudart_lib)
  list(APPEND TORCH_LIBRARIES localsgd_shim::cudart)
endif()
# The wheels are built with the C++11 ABI (torch._C._GLIBCXX_USE_CXX11_ABI).
set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=1")
set_target_properties(torch PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "${TORCH_INCLUDE_DIRS};${_shim_cuda_includes}"
  INTERFACE_COMPILE_OPTIONS "${TORCH_CXX_FLAGS}"
  CXX_STANDARD 17)
find_library(TORCH_LIBRARY torch PATHS "${_shim_root}/lib" NO_DEFAULT_PATH)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Torch DEFAULT_MSG TORCH_LIBRARY
  TORCH_INCLUDE_DIRS)
cmake_policy(POP)

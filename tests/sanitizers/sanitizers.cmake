# Sanitizer builds (scripts/sanitize.sh): included by the top-level
# CMakeLists.txt when LOCALSGD_SANITIZE is set, before any target exists, so
# every target of the project is compiled and linked with the sanitizer.
# LOCALSGD_SANITIZE is a -fsanitize= list: "address,undefined" or "thread".
string(REPLACE ";" "," _localsgd_sanitize "${LOCALSGD_SANITIZE}")
if(_localsgd_sanitize MATCHES "thread" AND
   _localsgd_sanitize MATCHES "address|leak|memory")
  message(FATAL_ERROR "LOCALSGD_SANITIZE=${_localsgd_sanitize}: "
    "ThreadSanitizer does not combine with Address/Leak/MemorySanitizer")
endif()
set(_localsgd_sanitize_flags
  -fsanitize=${_localsgd_sanitize} -fno-omit-frame-pointer)
if(_localsgd_sanitize MATCHES "undefined")
  # Undefined behaviour aborts (and fails the test) instead of logging.
  list(APPEND _localsgd_sanitize_flags -fno-sanitize-recover=undefined)
endif()
add_compile_options(${_localsgd_sanitize_flags})
add_link_options(${_localsgd_sanitize_flags})
message(STATUS "localsgd: sanitizers: ${_localsgd_sanitize}")

if(_localsgd_sanitize MATCHES "thread")
  # Debian's Abseil is not built with TSan: annotate absl::Mutex & co. in
  # every executable (tsan_absl_mutex.cc says why and how).
  add_library(localsgd_tsan_absl OBJECT
    ${CMAKE_CURRENT_LIST_DIR}/tsan_absl_mutex.cc)
  target_link_libraries(localsgd_tsan_absl PUBLIC
    absl::synchronization absl::time ${CMAKE_DL_LIBS})
  link_libraries(
    "$<$<STREQUAL:$<TARGET_PROPERTY:TYPE>,EXECUTABLE>:localsgd_tsan_absl>")
endif()

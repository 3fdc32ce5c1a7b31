#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: a coordinator and 4
# Local SGD workers training a CNN on Fashion-MNIST on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
exec scripts/run-demo.sh "$@"

#!/usr/bin/env bash
# The GPU check's old name: benchmarks/gpu_session.sh is the one command now (its
# header says what it does); this runs it, with the same environment and exit status.
exec "$(dirname "${BASH_SOURCE[0]}")/gpu_session.sh" "$@"

#!/usr/bin/env bash
# The test suite as one pytest process per core (what `make test` and CI run). Each shard holds
# whole test files, balanced by tests/durations.json; OpenBLAS gets one thread per process so the
# shards do not fight over the cores. Extra arguments go to every shard's pytest.
# One shard alone: .venv/bin/python -m pytest -q --shard 1/2
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
N=${KNORM_TEST_SHARDS:-$(nproc 2>/dev/null || echo 2)}
[ "$N" -ge 1 ] 2>/dev/null || N=2
[ "$N" -le 4 ] || N=4
if [ "$N" -eq 1 ]; then
    exec "$PY" -m pytest -q "$@"
fi
logs=$(mktemp -d)
start=$(date +%s)
pids=()
for k in $(seq 1 "$N"); do
    OPENBLAS_NUM_THREADS=1 "$PY" -m pytest -q -p no:cacheprovider --shard "$k/$N" "$@" >"$logs/shard$k.log" 2>&1 &
    pids+=($!)
done
rc=0
ran=0
for k in $(seq 1 "$N"); do
    wait "${pids[$((k - 1))]}"
    status=$?
    echo "---- shard $k/$N"
    cat "$logs/shard$k.log"
    case $status in
        0) ran=1 ;;
        5) ;;  # this shard holds none of the tests asked for
        *) rc=1 ;;
    esac
done
[ $rc -ne 0 ] || [ $ran -eq 1 ] || rc=5
echo "---- $N shards, $(( $(date +%s) - start )) s of wall time; exit $rc"
rm -rf "$logs"
exit $rc

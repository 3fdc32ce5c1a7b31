#!/usr/bin/env bash
# Process-level check of per-job tokens on the real coordinator binary:
# plaintext WARNING at start; a member with its job's token syncs, without a
# token / with a foreign token it is refused; localsgdctl status needs the
# token; `kill -HUP` rotates the tokens (a bad file keeps the old ones and
# logs the line); no token ever appears in the coordinator's log, the
# metrics or localsgdctl's output; bad TLS files stop the start naming the
# flag (from the environment, LOCALSGD_*); SIGTERM exits 0.
#
# usage: token_process_test.sh COORDINATOR SECURITY_MEMBER LOCALSGDCTL
set -euo pipefail
COORD=$1 MEMBER=$2 CTL=$3
DIR=$(mktemp -d)
PID=
cleanup() {
  if [[ -n $PID ]] && kill -0 "$PID" 2>/dev/null; then kill -9 "$PID"; fi
  rm -rf "$DIR"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*"
  echo "--- coordinator log"
  cat "$DIR/log" 2>/dev/null || true
  exit 1
}

# Waits (at most 20 s) until `$@` succeeds.
wait_for() {
  for _ in $(seq 200); do
    if "$@"; then return 0; fi
    sleep 0.1
  done
  return 1
}

token() { od -An -N16 -tx1 /dev/urandom | tr -d ' \n'; }
T1=$(token)
T2=$(token)
T3=$(token)
umask 077
printf '# test\njob-a %s\n' "$T1" >"$DIR/tokens"
echo "$T1" >"$DIR/t1"
echo "$T2" >"$DIR/t2"
echo "$T3" >"$DIR/t3"

"$COORD" --listen=127.0.0.1:0 --port_file="$DIR/port" \
  --metrics_listen=127.0.0.1:0 --metrics_port_file="$DIR/mport" \
  --token_file="$DIR/tokens" --lease_ttl=5s 2>"$DIR/log" &
PID=$!
wait_for test -s "$DIR/port" || fail "coordinator did not start"
PORT=$(cat "$DIR/port")
MPORT=$(cat "$DIR/mport")
TARGET=127.0.0.1:$PORT

grep -q "WARNING.*plaintext gRPC" "$DIR/log" ||
  grep -q "^W.*plaintext gRPC" "$DIR/log" || fail "no plaintext WARNING"

# A member with job-a's token syncs.
out=$("$MEMBER" --target="$TARGET" --job=job-a --name=m1 \
  --token_file="$DIR/t1") || fail "member with the right token: $out"
[[ $out == "ok round=1" ]] || fail "member: $out"

# Without a token: UNAUTHENTICATED; with a token of no job: PERMISSION_DENIED.
out=$("$MEMBER" --target="$TARGET" --job=job-a --name=m2) &&
  fail "member without a token joined"
[[ $out == "error UNAUTHENTICATED"* ]] || fail "no token: $out"
out=$("$MEMBER" --target="$TARGET" --job=job-a --name=m2 \
  --token_file="$DIR/t2") && fail "member with a foreign token joined"
[[ $out == "error PERMISSION_DENIED"* ]] || fail "foreign token: $out"

# localsgdctl: status needs the token.
"$CTL" --target="$TARGET" status >"$DIR/ctl.out" 2>&1 &&
  fail "status without a token succeeded"
grep -q UNAUTHENTICATED "$DIR/ctl.out" || fail "ctl: $(cat "$DIR/ctl.out")"
"$CTL" --target="$TARGET" --token_file="$DIR/t1" status --job=job-a \
  >>"$DIR/ctl.out" 2>&1 || fail "status with the token: $(cat "$DIR/ctl.out")"
grep -q "^job job-a" "$DIR/ctl.out" || fail "ctl output: $(cat "$DIR/ctl.out")"

# Rotation by SIGHUP: job-a's token becomes T2; job-b gets T3 as a digest.
printf 'job-a %s\njob-b sha256:%s\n' "$T2" \
  "$(printf '%s' "$T3" | sha256sum | cut -d' ' -f1)" >"$DIR/tokens.new"
mv "$DIR/tokens.new" "$DIR/tokens"
kill -HUP "$PID"
wait_for grep -q "per-job tokens reloaded: 2 jobs" "$DIR/log" ||
  fail "no reload logged"
"$CTL" --target="$TARGET" --token_file="$DIR/t1" status --job=job-a \
  >>"$DIR/ctl.out" 2>&1 && fail "the old token still works after SIGHUP"
tail -1 "$DIR/ctl.out" | grep -q PERMISSION_DENIED ||
  fail "old token: $(tail -1 "$DIR/ctl.out")"
"$CTL" --target="$TARGET" --token_file="$DIR/t2" status --job=job-a \
  >>"$DIR/ctl.out" 2>&1 || fail "the new token is refused"
out=$("$MEMBER" --target="$TARGET" --job=job-b --name=b1 \
  --token_file="$DIR/t3") || fail "job-b with its digest-listed token: $out"

# A bad file on SIGHUP: logged with its line, the tokens stay.
printf 'job-a %s\n%s\n' "$T1" "$T1" >"$DIR/tokens.new"
mv "$DIR/tokens.new" "$DIR/tokens"
kill -HUP "$PID"
wait_for grep -q "reloading the token file failed: .*tokens:2:" "$DIR/log" ||
  fail "bad file on reload not logged with its line"
grep -q "keeping the 2 job tokens" "$DIR/log" || fail "no 'keeping' in log"
"$CTL" --target="$TARGET" --token_file="$DIR/t2" status --job=job-a \
  >>"$DIR/ctl.out" 2>&1 || fail "tokens lost after a bad reload"

# No token anywhere: log, metrics, ctl output.
exec 3<>"/dev/tcp/127.0.0.1/$MPORT"
printf 'GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n' >&3
cat <&3 >"$DIR/metrics"
exec 3<&-
grep -q localsgd_requests_rejected_total "$DIR/metrics" || fail "no metrics"
for t in "$T1" "$T2" "$T3"; do
  ! grep -q "$t" "$DIR/log" || fail "a token is in the coordinator's log"
  ! grep -q "$t" "$DIR/metrics" || fail "a token is in the metrics"
  ! grep -q "$t" "$DIR/ctl.out" || fail "a token is in localsgdctl's output"
done

kill -TERM "$PID"
rc=0
wait "$PID" || rc=$?
PID=
[[ $rc == 0 ]] || fail "exit status $rc after SIGTERM"

# Bad TLS files, from the environment, stop the start naming the flag.
rc=0
LOCALSGD_TLS_CERT="$DIR/missing.pem" LOCALSGD_TLS_KEY="$DIR/t1" \
  "$COORD" --listen=127.0.0.1:0 2>"$DIR/log2" || rc=$?
[[ $rc == 1 ]] || fail "bad --tls_cert: exit $rc"
grep -q -- "--tls_cert file '$DIR/missing.pem'" "$DIR/log2" ||
  fail "bad --tls_cert: $(cat "$DIR/log2")"
rc=0
"$COORD" --listen=127.0.0.1:0 --token_file="$DIR/missing" 2>"$DIR/log2" ||
  rc=$?
[[ $rc == 1 ]] && grep -q -- "--token_file" "$DIR/log2" ||
  fail "missing --token_file: exit $rc: $(cat "$DIR/log2")"
echo OK

#!/usr/bin/env bash
# The main job, on a fresh machine without a GPU: install, start ds4-server on 127.0.0.1:8000 in the
# background with the shipped ds4-tiny ① base, print the answer to a one-line test question, and leave the
# server running. Running it again reuses an already-running server.
#
# Usage: bash scripts/main.sh [start] [--rebuild] [--domain finance|code|law|medicine|science|none]
#                             [--host H] [--port N]
#        bash scripts/main.sh stop        # stop the server this script started
#        bash scripts/main.sh status      # is it running, and where
# --rebuild: build the ① base from the checkpoint with `ds4 quantize` into cache/ (minutes on 2 cores; the same
#            bytes as the shipped file) and serve that one instead.
# Files: models/ds4-tiny-base.gguf (the shipped ① base), cache/ds4-tiny-base.gguf (--rebuild), cache/server.pid,
#        cache/server.log (the server's log).
# Domain sidecars: models/sidecars/<domain>/ (committed beside the model; solved by `ds4 sidecar` or
# notebooks/sidecar.ipynb, see docs/sidecar.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CHECKPOINT=$ROOT/models/ds4-tiny
SHIPPED_BASE=$ROOT/models/ds4-tiny-base.gguf
BUILT_BASE=$ROOT/cache/ds4-tiny-base.gguf
SIDECARS=${DS4_SIDECARS_DIR:-$ROOT/models/sidecars}      # override: tests
PIDFILE=$ROOT/cache/server.pid
ARGSFILE=$ROOT/cache/server.args
LOG=$ROOT/cache/server.log
QUESTION="What does 'ledger' mean?"
ACTION=start DOMAIN=none HOST=127.0.0.1 PORT=8000 REBUILD=0

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "scripts/main.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        start|stop|status) ACTION=$1 ;;
        --rebuild) REBUILD=1 ;;
        --domain) DOMAIN=${2:?--domain needs a value}; shift ;;
        --domain=*) DOMAIN=${1#--domain=} ;;
        --host) HOST=${2:?--host needs a value}; shift ;;
        --host=*) HOST=${1#--host=} ;;
        --port) PORT=${2:?--port needs a value}; shift ;;
        --port=*) PORT=${1#--port=} ;;
        -h|--help) usage; exit 0 ;;
        *) echo "scripts/main.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

server_pid() {          # the pid of the ds4-server this script started, if it is still alive
    [ -f "$PIDFILE" ] || return 1
    local pid
    pid=$(cat "$PIDFILE")
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && ps -p "$pid" -o args= | grep -q "ds4-server" && echo "$pid"
}

case "$ACTION" in
    stop)
        if pid=$(server_pid); then
            kill -TERM "$pid"
            for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
            rm -f "$PIDFILE" "$ARGSFILE"
            echo "ds4-server (pid $pid) stopped"
        else
            rm -f "$PIDFILE" "$ARGSFILE"
            echo "ds4-server is not running"
        fi
        exit 0 ;;
    status)
        if pid=$(server_pid); then
            echo "ds4-server is running (pid $pid): $(cat "$ARGSFILE" 2>/dev/null); log: $LOG"
        else
            echo "ds4-server is not running"
            exit 3
        fi
        exit 0 ;;
esac

# ---- the domain: checked first, so a domain that cannot be served costs no install and no build
ZCHAIN=()
case "$DOMAIN" in
    none) ;;
    finance|code|law|medicine|science)
        if [ -f "$SIDECARS/$DOMAIN/manifest.json" ]; then
            ZCHAIN=(--zchain "$SIDECARS/$DOMAIN")
        else
            die "no ② sidecar for '$DOMAIN' in this checkout (looked for ${SIDECARS#$ROOT/}/$DOMAIN/manifest.json).
Solve it on the shipped ① base:
    .venv/bin/ds4 sidecar --base models/ds4-tiny-base.gguf --domain $DOMAIN --fit $DOMAIN/fit --out models/sidecars/$DOMAIN
or serve the bare ① base with --domain none (the default)."
        fi ;;
    *) echo "scripts/main.sh: --domain must be finance, code, law, medicine, science or none (got '$DOMAIN')" >&2
       exit 2 ;;
esac
if [ "$REBUILD" = 1 ]; then BASE=$BUILT_BASE; else BASE=$SHIPPED_BASE; fi
WANT="--domain $DOMAIN --host $HOST --port $PORT --base $BASE"
if pid=$(server_pid) && [ "$(cat "$ARGSFILE" 2>/dev/null)" != "$WANT" ]; then
    die "a ds4-server started by this script is already running (pid $pid: $(cat "$ARGSFILE" 2>/dev/null));
stop it first with: bash scripts/main.sh stop"
fi

echo "[1/4] installing (scripts/setup.sh: .venv and the ds4 package; quick when already done)"
bash scripts/setup.sh

if [ "$REBUILD" = 1 ]; then
    echo "[2/4] rebuilding the ① base $BASE from $CHECKPOINT"
    echo "      (ds4 quantize on the CPU: several minutes on 2 cores; the shipped $SHIPPED_BASE is the same bytes)"
    .venv/bin/ds4 quantize --checkpoint "$CHECKPOINT" --out "$BASE" --quiet
else
    [ -s "$BASE" ] || die "the shipped ① base $BASE is missing; rebuild it with: bash scripts/main.sh --rebuild"
    echo "[2/4] serving the shipped ① base $BASE (bash scripts/main.sh --rebuild builds it from $CHECKPOINT)"
fi

URL="http://$HOST:$PORT"
if pid=$(server_pid); then
    echo "[3/4] reusing the running ds4-server (pid $pid) at $URL"
else
    echo "[3/4] starting ds4-server at $URL (domain: $DOMAIN${ZCHAIN:+, sidecar ${ZCHAIN[1]#$ROOT/}}; log: $LOG)"
    mkdir -p "$(dirname "$LOG")"
    setsid nohup .venv/bin/ds4-server -m "$BASE" --engram-dir "$CHECKPOINT" "${ZCHAIN[@]}" --alias ds4-tiny \
        --host "$HOST" --port "$PORT" >"$LOG" 2>&1 </dev/null &
    pid=$!
    echo "$pid" > "$PIDFILE"
    echo "$WANT" > "$ARGSFILE"
fi

# ---- wait for /health, ask the question (greedy: temperature 0), print the answer
.venv/bin/python - "$URL" "$QUESTION" "$pid" "$LOG" <<'EOF'
import json, os, sys, time, urllib.error, urllib.request

url, question, pid, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
deadline = time.monotonic() + 600
while True:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            if r.status == 200:
                break
    except (urllib.error.URLError, OSError):
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(f"ds4-server exited during startup; the end of {log}:\n" + "".join(open(log).readlines()[-20:]))
    if time.monotonic() > deadline:
        sys.exit(f"ds4-server did not become healthy in 600 s; see {log}")
    time.sleep(0.5)
body = {"model": "ds4-tiny", "messages": [{"role": "user", "content": question}], "temperature": 0,
        "max_tokens": 128}
req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=300) as r:
    reply = json.load(r)
with urllib.request.urlopen(url + "/health", timeout=5) as r:
    domain = json.load(r).get("domain")
print(f"[4/4] test question (temperature 0; domain served: {domain}):")
print(f"  Q: {question}")
answer = reply["choices"][0]["message"]["content"].strip()
print("  A: " + answer.replace("\n", "\n     "))
u = reply["usage"]
print(f"     ({u['prompt_tokens']} prompt + {u['completion_tokens']} generated tokens, "
      f"finish: {reply['choices'][0]['finish_reason']})")
EOF

echo
echo "ds4-server keeps running at $URL (pid $pid): chat page $URL/, OpenAI API $URL/v1, Anthropic API $URL."
echo "Stop it with: bash scripts/main.sh stop"

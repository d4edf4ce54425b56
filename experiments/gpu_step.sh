# Sourced by gpu_check.sh: ``step``, one time-limited step of the check. Needs LOG_DIR and START (the check's
# start, in epoch seconds); reads STEPS (run only the steps whose names contain one of its words) and DEADLINE_S.
step() {  # step NAME SECONDS COMMAND...: runs it, logs to LOG_DIR/NAME.log, its exit status to NAME.status
    local name=$1 seconds=$2
    shift 2
    if [ -n "${STEPS:-}" ]; then
        local word wanted=0
        for word in $STEPS; do case $name in *"$word"*) wanted=1 ;; esac; done
        [ "$wanted" = 1 ] || return 0
    fi
    if [ -n "${DEADLINE_S:-}" ]; then
        local left=$((START + DEADLINE_S - $(date +%s)))
        if [ "$left" -lt 15 ]; then
            echo "== $name: skipped, DEADLINE_S=$DEADLINE_S reached"
            echo 124 >"$LOG_DIR/$name.status"
            return 0
        fi
        [ "$left" -lt "$seconds" ] && seconds=$left
    fi
    echo "== $name (${seconds} s at most): $*"
    local status=0
    # -k: a step ignoring TERM (a hung CUDA call) is killed, so that the GPU is free for the next one.
    timeout -k 10 "$seconds" "$@" >"$LOG_DIR/$name.log" 2>&1 || status=$?
    echo "$status" >"$LOG_DIR/$name.status"
    if [ "$status" = 0 ]; then
        echo "   $name ok ($(tail -n 1 "$LOG_DIR/$name.log"))"
    else
        echo "   $name FAILED (status $status); last lines of $LOG_DIR/$name.log:"
        tail -n 25 "$LOG_DIR/$name.log" | sed "s/^/   $name | /"
    fi
}

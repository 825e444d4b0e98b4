#!/bin/bash
# The pre-registered studies too long for one sitting, run in the background across sittings and machines: each
# study's finished runs travel in docs/results/<study>/carry/ (checkpoints are too large for git), so a fresh machine
# continues where the last one stopped instead of starting over.
#
#   bash scripts/studies.sh restore   # code snapshot + .venv, each --out rebuilt from carry/ (what is there is kept)
#   bash scripts/studies.sh start [N] # N processes per study (default 1; they share its runs, each claimed by the
#                                     # process training it) at the lowest priority, less those running; logs beside;
#                                     # the snapshot's run list is first this checkout's (an amendment may add runs)
#   bash scripts/studies.sh status    # finished runs per study, runs in progress and their newest checkpoint
#   bash scripts/studies.sh carry     # each newly finished run's small files into docs/results/<study>/carry/
#   bash scripts/studies.sh stop      # SIGTERM (a run in progress checkpoints), then end the processes; then carry
#   bash scripts/studies.sh drain [M] # each process ends once its run in progress has finished (stop after M minutes,
#                                     # default 60), then carry: a machine that will not stay loses no training
#
# STUDIES (default /work/studies) holds the runs; each study runs from the snapshot of one commit (REV_OF below) for
# its whole life, so every run computes with the same code (REV, if set, replaces them all); RESULTS: where carry/ is.
set -euo pipefail
STUDIES=${STUDIES:-/work/studies}
REPO=$(cd "$(dirname "$0")/.." && pwd)
RESULTS=${RESULTS:-$REPO/docs/results}  # carry/ lives here
FLOW=$STUDIES/dit_flow  # dit_hc_attnres shares dit_flow's --out: their DDPM runs are the same folders

# study -> its commit, its --out, its extra arguments, the runs it carries (a regex on the run folder's name)
declare -A REV_OF=([deit_hc_attnres]=737261e [dit_flow]=737261e [dit_hc_attnres]=737261e
                   [deit_attnres]=8172519 [dit_routing]=8172519 [deit3_depth]=e9394d6 [dit_lightning]=60c398a)
declare -A OUT=([deit_hc_attnres]=$STUDIES/deit_hc_attnres [dit_flow]=$FLOW [dit_hc_attnres]=$FLOW
                [deit_attnres]=$STUDIES/deit_attnres [dit_routing]=$STUDIES/dit_routing
                [deit3_depth]=$STUDIES/deit3_depth [dit_lightning]=$STUDIES/dit_lightning)
declare -A ARGS=(
  [deit_hc_attnres]=""
  [dit_flow]="--feature-weights $FLOW/fmnist_cnn.safetensors --encoder-weights $FLOW/encoder/model.safetensors"
  [dit_hc_attnres]="--feature-weights $FLOW/fmnist_cnn.safetensors"
  [deit_attnres]=""
  [dit_routing]="--feature-weights $FLOW/fmnist_cnn.safetensors"
  [deit3_depth]=""
  [dit_lightning]="--feature-weights $FLOW/fmnist_cnn.safetensors")
declare -A OWN=([deit_hc_attnres]='.' [dit_hc_attnres]='^(mhc|attnres)_'
                [dit_flow]='^(pre|siamese|flow_pre|flow_siamese|repa_pre|repa_siamese)_'
                [deit_attnres]='.' [dit_routing]='.' [deit3_depth]='.' [dit_lightning]='.')
ORDER=(deit_hc_attnres dit_flow dit_hc_attnres deit_attnres dit_routing deit3_depth dit_lightning)
FINISHED=" deit_hc_attnres dit_flow dit_hc_attnres deit3_depth dit_lightning "  # every run done and carried: restored and reported, not started

code_of() {  # the study's code snapshot
  echo "$STUDIES/code_${REV:-${REV_OF[$1]}}"
}

running_studies() {  # the studies `start` starts
  for study in "${ORDER[@]}"; do
    [[ $FINISHED == *" $study "* ]] || echo "$study"
  done
}

pids_of() {  # the study's scripts.compare processes
  pgrep -f "scripts.compare --study $1 --out ${OUT[$1]} " || true
}

grids_of() {  # the study's run list: the "      - {...}" lines under its "    grids:" in the compare.yaml on stdin
  awk -v study="  $1:" '$0 == study {inside = 1; next} inside && /^  [^ #]/ {inside = 0}
    inside && $0 == "    grids:" {grids = 1; next} grids && /^      - / {print; next} {grids = 0}'
}

sync_grids() {  # the snapshot runs the study's list as this checkout's compare.yaml has it (an amendment may add runs
  # after the snapshot was taken; their preregistration.md says why); every setting and all code stay the snapshot's
  local snapshot grids
  snapshot=$(code_of "$1")/configs/compare.yaml
  [ -f "$snapshot" ] || return 0
  grids=$(grids_of "$1" < "$REPO/configs/compare.yaml")
  [ -n "$grids" ] && [ "$grids" != "$(grids_of "$1" < "$snapshot")" ] || return 0
  awk -v study="  $1:" -v grids="$grids" '$0 == study {inside = 1} inside && /^  [^ #]/ && $0 != study {inside = 0}
    inside && $0 == "    grids:" {print; print grids; skip = 1; next} skip && /^      - / {next} {skip = 0; print}' \
    "$snapshot" > "$snapshot.new"
  mv "$snapshot.new" "$snapshot"
  echo "$1: its snapshot's run list updated from configs/compare.yaml"
}

alive() {  # the process still runs scripts.compare (an ended one, zombie or gone, has no command line)
  grep -q scripts.compare "/proc/$1/cmdline" 2> /dev/null
}

group_of() {  # a process's group: the study's processes, its runs' workers included
  ps -o pgid= -p "$1" | tr -d ' '
}

end_group() {  # SIGKILL a study process's group; return once the process is gone (up to 10 s), so status is true
  kill -9 -- "-$2" 2> /dev/null || true
  for _ in $(seq 100); do
    alive "$1" || return 0
    sleep 0.1
  done
}

restore() {
  for study in $(running_studies); do
    local code
    code=$(code_of "$study")
    [ -x "$code/.venv/bin/python" ] && continue
    mkdir -p "$code"
    git -C "$REPO" archive "${REV:-${REV_OF[$study]}}" | tar -x -C "$code"
    python3 -m venv "$code/.venv"
    "$code/.venv/bin/python" -m pip install -q -e "$code[test]"
  done
  bash "$REPO/scripts/install_fashion_mnist.sh"
  mkdir -p "$FLOW/encoder"
  [ -f "$FLOW/fmnist_cnn.safetensors" ] || cp "$RESULTS/dit_flow/carry/fmnist_cnn.safetensors" "$FLOW/"
  [ -f "$FLOW/encoder/model.safetensors" ] || cp "$RESULTS/dit_flow/carry/encoder/"* "$FLOW/encoder/"
  for study in "${ORDER[@]}"; do
    mkdir -p "${OUT[$study]}/runs"
    for run in "$RESULTS/$study/carry/finished/"*/; do
      [ -d "$run" ] || continue  # a study with nothing carried yet
      [ -d "${OUT[$study]}/runs/$(basename "$run")" ] || cp -r "$run" "${OUT[$study]}/runs/"
    done
  done
  status
}

start() {
  local processes=${1:-1}
  [[ $processes =~ ^[1-9][0-9]*$ ]] ||
    { echo "start takes a number of processes per study, e.g. \`start 2\` (got '$processes')"; exit 2; }
  for study in $(running_studies); do
    local running code
    code=$(code_of "$study")
    [ -x "$code/.venv/bin/python" ] ||
      { echo "no snapshot at $code: run \`bash scripts/studies.sh restore\` first"; exit 2; }
    sync_grids "$study"  # a process already running keeps the list it read; the next one reads the new list
    running=$(pids_of "$study" | wc -l)
    [ "$running" -eq 0 ] || echo "$study runs already (pids $(pids_of "$study" | paste -sd' '))"
    mkdir -p "$STUDIES/$study"
    for k in $(seq $((running + 1)) "$processes"); do
      local log=$STUDIES/$study/study$([ "$k" -gt 1 ] && echo "$k").log
      # autogroup 19: with the kernel's autogroup on, nice alone ranks processes only within their own session
      setsid nohup bash -c "echo 19 > /proc/self/autogroup; cd $code && PYTHONPATH=$code OMP_NUM_THREADS=1 \
        exec nice -n 19 .venv/bin/python -m scripts.compare --study $study --out ${OUT[$study]} ${ARGS[$study]} \
        --report $STUDIES/$study/report" >> "$log" 2>&1 < /dev/null &
      echo "$study started; log $log"
    done
  done
}

status() {
  for study in "${ORDER[@]}"; do
    local runs=${OUT[$study]}/runs finished=0 line=""
    for run in "$runs"/*/; do
      [ -d "$run" ] && basename "$run" | grep -qE "${OWN[$study]}" || continue
      if [ -f "$run/result.json" ]; then finished=$((finished + 1)); continue; fi
      local newest logged
      newest=$(ls "$run/checkpoints" 2>/dev/null | tail -1 || true)
      logged=$(tail -1 "$run/metrics.jsonl" 2>/dev/null | grep -o '"step": [0-9]*' | tr -d '"' || true)
      line+=" $(basename "$run")(${logged:+$logged, }${newest:-no checkpoint})"
    done
    local running
    running=$(pids_of "$study" | wc -l)
    local state=running
    [ "$running" -eq 0 ] && state=stopped
    [ "$running" -gt 1 ] && state="running ($running processes)"
    echo "$study: $finished finished;${line:- nothing in progress}; $state"
  done
}

carry() {
  for study in "${ORDER[@]}"; do
    for run in "${OUT[$study]}/runs/"*/; do
      local name
      name=$(basename "$run")
      [ -f "$run/result.json" ] && echo "$name" | grep -qE "${OWN[$study]}" || continue
      [ -d "$RESULTS/$study/carry/finished/$name" ] && continue
      mkdir -p "$RESULTS/$study/carry/finished/$name"
      # metrics.jsonl: the report's steps/s column reads it
      for f in result.json compare_settings.json config.yaml diagnostics.json final_metrics.json metrics.jsonl; do
        [ -f "$run/$f" ] && cp "$run/$f" "$RESULTS/$study/carry/finished/$name/"
      done
      echo "carried $study/$name"
    done
  done
}

stop() {
  # The snapshot's scripts.compare begins the next run after a SIGTERM, so each process group ends once its run
  # has said it checkpointed (in the process's own log) or its scripts.compare has ended (or after 10 minutes).
  local -A seen pgid log study
  for name in "${ORDER[@]}"; do
    for pid in $(pids_of "$name"); do
      study[$pid]=$name
      log[$pid]=$(readlink "/proc/$pid/fd/1" || true)  # its stdout: the log `start` gave it
      seen[$pid]=$(stop_lines "${log[$pid]}" | wc -l)
      pgid[$pid]=$(group_of "$pid")
      kill -TERM "$pid"
    done
  done
  for _ in $(seq 120); do
    for pid in "${!seen[@]}"; do
      if [ "$(stop_lines "${log[$pid]}" | wc -l)" -gt "${seen[$pid]}" ]; then
        echo "${study[$pid]}: $(stop_lines "${log[$pid]}" | tail -1)"
      elif ! alive "$pid"; then  # a run that was sampling or scoring ends on the signal, unsaid
        echo "${study[$pid]}: ended on the signal (a run that was evaluating resumes from its last checkpoint)"
      else
        continue
      fi
      end_group "$pid" "${pgid[$pid]}"
      unset "seen[$pid]"
    done
    [ ${#seen[@]} -eq 0 ] && break
    sleep 5
  done
  for pid in "${!seen[@]}"; do
    end_group "$pid" "${pgid[$pid]}"
    echo "${study[$pid]}: no checkpoint line within 10 minutes; ended (it resumes from its last checkpoint)"
  done
  carry
  status
}

drain() {
  # A checkpoint of a run in progress stays on this machine, so before the machine goes each process finishes its run
  # (the run folder whose .lock it holds) and ends before it trains the next; the others get its core.
  local minutes=${1:-60} poll=${DRAIN_POLL:-30}
  [[ $minutes =~ ^[0-9]+$ ]] || { echo "drain takes whole minutes, e.g. \`drain 45\` (got '$minutes')"; exit 2; }
  local -A run=() pgid=() study=()
  for name in "${ORDER[@]}"; do
    for pid in $(pids_of "$name"); do
      pgid[$pid]=$(group_of "$pid")
      study[$pid]=$name
    done
  done
  local deadline=$((SECONDS + minutes * 60))
  while [ ${#pgid[@]} -gt 0 ] && [ $SECONDS -lt $deadline ]; do
    for pid in "${!pgid[@]}"; do
      [ -n "${run[$pid]:-}" ] || run[$pid]=$(locked_run "${pgid[$pid]}")
      if ! alive "$pid"; then
        echo "${study[$pid]}: its process ended"
      elif [ -n "${run[$pid]}" ] && [ -f "${run[$pid]}/result.json" ]; then
        end_group "$pid" "${pgid[$pid]}"
        echo "${study[$pid]}: $(basename "${run[$pid]}") finished; ended before the next run"
      else
        continue
      fi
      unset "pgid[$pid]"
    done
    [ ${#pgid[@]} -eq 0 ] || sleep "$poll"
  done
  if [ ${#pgid[@]} -gt 0 ]; then
    echo "after $minutes minutes: $(printf '%s\n' "${study[@]}" | sort -u | paste -sd' ') still training;" \
         "stopping with a checkpoint"
    stop
  else
    carry
    status
  fi
}

locked_run() {  # the run folder whose .lock a process of the group holds (empty between runs)
  for p in $(pgrep -g "$1"); do
    ls -l "/proc/$p/fd" 2> /dev/null | grep -o '/[^ ]*/runs/[^/]*/\.lock'
  done | head -1 | sed 's|/\.lock$||' || true
}

stop_lines() {  # the lines of a process's log that say a run stopped with a checkpoint
  tr '\r' '\n' < "$1" 2> /dev/null | grep 'received: stopped at step' || true
}

case "${1:-}" in
  restore|start|status|carry|stop|drain) "$@" ;;
  *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac

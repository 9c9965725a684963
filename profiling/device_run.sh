#!/usr/bin/env bash
# One device call: build for sm_80/sm_90, GPU tests, compute-sanitizer, calibration, benchmarks.
#   bash profiling/device_run.sh [steps...]     (from the repository root; scripts run as python3 -m profiling.<dir>.<name>)
#   steps: build test gputest sanitize faultsan abortsan integrity vllm-matrix vllm-tests vllm-hybrid vllm-memcheck vllm-bench soak (those need /tmp/vsite/env.sh sourced)
#          calib calibseq transfer transfer-quick idsuva layout connector ttft throughput fig2big fig6 hostprof hostlines dupsplit wake ringwc hostsub coldsub order power smprobe lanes ce tpdiag stagedprobe probe-staged stagedfault stagedstress nsys multigpu
#   env: KVO_GIT_SHA (recorded in results; pass it as a literal sha: the device copy's git metadata can be stale),
#        KVO_DEADLINE_S (cut steps so everything is packed within this many seconds; set it below the call's limit), KVO_PYTEST_ARGS (test step selection, default: tests), KVO_PYTEST_K (its -k expression), KVO_TP_ARGS / KVO_TRANSFER_ARGS / KVO_SOAK_ARGS (extra bench_throughput / bench_transfer / soak_vllm arguments), KVO_SOAK_S (soak: offloaded seconds, default 480),
#        NSYS (the nsys binary for the nsys step; default: nsys on PATH)
# Results go to $OUT (the device tool's output folder) or ./device_out. Keep the file count small:
# the device tool returns at most 8 files.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
# everything lands in $R, outside $OUT, and is packed into $OUT/results.tgz after each step: the
# device tool returns at most 8 files from $OUT, so loose files there could crowd the archive out
export KVO_R=${KVO_R:-$(mktemp -d /tmp/kvo_r.XXXXXX)}; R=$KVO_R
[ -n "$R" ] && mkdir -p "$R" || { echo "device_run: no results folder (mktemp failed)"; exit 1; }
export PYTHONUNBUFFERED=1 KVO_RESULTS=$R KVO_CACHE_DIR=$R
steps=${*:-build test sanitize calib transfer}
[ -n "${KVO_GIT_SHA:-}" ] || echo "warning: KVO_GIT_SHA unset: results record this copy's git HEAD, which on the device can be stale"
if [ -n "${KVO_DEADLINE_S:-}" ] && [ -z "${KVO_INNER:-}" ]; then
  # each step under `timeout`, so a step that runs long still leaves the results packed before
  # the device tool's own limit (benchmarks rewrite their JSON as they go)
  for s in $steps; do
    rem=$((KVO_DEADLINE_S - SECONDS - 20))
    if [ $rem -le 0 ]; then echo "=== $s skipped: past KVO_DEADLINE_S=$KVO_DEADLINE_S"; continue; fi
    KVO_INNER=1 timeout $rem bash "$0" "$s" || echo "=== $s ended with status $? (124: cut at the deadline)"
    tar -czf $OUT/results.tgz -C $R .
  done
  exit 0
fi
log() { echo "=== $* ($(date +%T))"; }
for s in $steps; do
  case $s in
    build) log build; nvidia-smi -L
      python3 -m pip install -v -e . --no-build-isolation --no-deps > /tmp/build.log 2>&1 || {
        cp /tmp/build.log $R/; grep -iE "error|fatal" /tmp/build.log | head -20; tail -30 /tmp/build.log; }
      python3 -m kernels ;;
    test) log test  # KVO_PYTEST_K: a -k expression (KVO_PYTEST_ARGS is split on spaces)
      python3 -m pytest -q -rs ${KVO_PYTEST_ARGS:-tests} ${KVO_PYTEST_K:+-k "$KVO_PYTEST_K"} 2>&1 | tee $R/pytest.log | tail -25 ;;
    sanitize) log sanitize
      echo "# compute-sanitizer on tests/sanitize_kernels.py, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), sha ${KVO_GIT_SHA:-unknown}" > $R/sanitizer.log
      for tool in memcheck racecheck; do
        echo "### $tool" >> $R/sanitizer.log
        compute-sanitizer --tool $tool --error-exitcode 3 python3 tests/sanitize_kernels.py >> $R/sanitizer.log 2>&1
        echo "compute-sanitizer $tool: exit $?"; tail -n 2 $R/sanitizer.log
      done ;;
    calib) log calib; python3 -m kernels calibrate 2>&1 | tail -45 ;;
    calibseq) log calibseq; python3 -m kernels calibrate --curves gbps_hostseq 2>&1 | tail -30 ;;  # host-order DMA curve only
    transfer) log transfer; python3 -m profiling.bench.bench_transfer --out $R ${KVO_TRANSFER_ARGS:-} ;;
    transfer-quick) log transfer-quick; python3 -m profiling.bench.bench_transfer --quick --out $R ;;
    idsuva) log idsuva; python3 -m profiling.probes.probe_ids_uva --out $R ;;  # block ids via UVA vs uploaded, A/B
    layout) log layout; python3 -m profiling.bench.bench_layout --out $R ;;
    connector) log connector; python3 -m profiling.bench.bench_connector --out $R ;;
    ttft) log ttft; python3 -m profiling.bench.bench_ttft --out $R ;;
    throughput) log throughput; python3 -m profiling.bench.bench_throughput --out $R ${KVO_TP_ARGS:-} ;;
    fig2big) log fig2big  # Fig. 2 at the blog's 10,000 requests, in windows of 500 (a 32 GiB pool); hits
      # registered, not computed (--synthetic-hits); ~137 s per full no-offload pass: pick KVO_RATES to fit a call
      # (0,100,90,80 with the no-offload pass took ~500 s); later parts: KVO_TP_ARGS=--no-baseline (no rate 0)
      # results: throughput_10k_<rates>.{json,csv,png}, which summarize.py reads
      t=$(echo ${KVO_RATES:-0,100} | tr , _)
      python3 -m profiling.bench.bench_throughput --requests 10000 --window 500 --synthetic-hits --repeat 1 \
        --rates ${KVO_RATES:-0,100} --out $R/fig2big ${KVO_TP_ARGS:-}
      for e in json csv png; do [ -f $R/fig2big/throughput.$e ] && mv $R/fig2big/throughput.$e $R/throughput_10k_$t.$e; done ;;
    fig6) log fig6; python3 -m profiling.bench.bench_throughput --fig6 --repeat-hits 7 --out $R ${KVO_TP_ARGS:-} ;;
    hostprof) log hostprof
      { echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%FT%TZ), sha ${KVO_GIT_SHA:-unknown}"
        python3 -m profiling.probes.host_overhead; python3 -m profiling.probes.host_overhead --worker; } 2>&1 | tee $R/hostprof.txt ;;
    hostlines) log hostlines  # per statement of the worker's two fast paths, cold (after a 2 GB copy + sync) and busy
      { echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%FT%TZ), sha ${KVO_GIT_SHA:-unknown}"
        python3 -m profiling.probes.host_overhead --lines; } 2>&1 | tee $R/hostlines.txt ;;
    coldsub) log coldsub; python3 -m profiling.probes.probe_cold_submit --out $R ;;
    order) log order; python3 -m profiling.probes.probe_host_order --out $R ;;  # host-side id order; GEMM clocks beside DMA
    power) log power  # why compute slows beside DMA: clock event reasons (power cap?) and the power limit
      nvidia-smi -q -d POWER,PERFORMANCE,CLOCK > $R/nvsmi_power.txt 2>&1
      python3 -m profiling.probes.probe_host_order --skip order --name host_order_power \
        --clock-cases 2097152:random,262144:random,32768:sequential --out $R ;;
    dupsplit) log dupsplit  # the split duplicate check against the serial one (host only)
      g++ -O3 -std=c++17 -pthread -o /tmp/probe_dup_split profiling/probes/probe_dup_split.cpp &&
        { echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) host, $(date -u +%FT%TZ), sha ${KVO_GIT_SHA:-unknown}"
          /tmp/probe_dup_split; } 2>&1 | tee $R/dup_split.txt ;;
    wake) log wake  # waking the host pool's sleeping helpers ahead of a cold id pass (host only)
      g++ -O3 -std=c++17 -pthread -o /tmp/probe_wake profiling/probes/probe_wake.cpp &&
        { echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) host, $(date -u +%FT%TZ), sha ${KVO_GIT_SHA:-unknown}"
          /tmp/probe_wake; } 2>&1 | tee $R/wake.txt ;;
    ringwc) log ringwc  # the cold id pass into a cached vs a write-combined pinned slot
      nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -o /tmp/probe_ring_wc profiling/probes/probe_ring_wc.cu &&
        { echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%FT%TZ), sha ${KVO_GIT_SHA:-unknown}"
          /tmp/probe_ring_wc; } 2>&1 | tee $R/ring_wc.txt ;;
    hostsub) log hostsub  # host submit time only (plus the same-run references): transfer_host.json
      python3 -m profiling.bench.bench_transfer --skip sweep,ctas,bidir,interference --out $R/hostsub &&
        for e in json csv; do cp $R/hostsub/transfer.$e $R/transfer_host.$e; done; rm -rf $R/hostsub ;;
    smprobe) log smprobe  # SM-issued PCIe ceiling per PTX load/store flavour (probe_sm_pcie.cu)
      nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -o /tmp/probe_sm_pcie profiling/probes/probe_sm_pcie.cu &&
        /tmp/probe_sm_pcie $R/probe_sm_pcie.json | tee $R/probe_sm_pcie.txt ;;
    probe-staged) log probe-staged  # issue 36: the C++ and the Python staged pipeline, same jobs, alone and beside a GEMM (~60-90 s)
      python3 -m profiling.probes.probe_staged_pipes --out $R 2>&1 | tee $R/staged_pipes.txt ;;
    lanes) log lanes; python3 -m profiling.probes.probe_dma_lanes --out $R ;;  # DMA split over streams
    ce) log ce; python3 -m profiling.probes.ce_contention --out $R ;;  # small copies behind bulk DMA
    tpdiag) log tpdiag  # 100%-hit throughput, 8B, max_seqs 64: defaults, graphs off, native submit
      for v in "" "--cuda-graph-seqs 0" "--native-submit"; do
        echo "### tpdiag ${v:-defaults}"
        python3 -m profiling.bench.bench_throughput --max-seqs 64 --requests 400 --rates 100 --repeat 1 --out $R/tpdiag$(echo $v | tr -d ' -') $v 2>&1 | grep -v Warning
      done 2>&1 | tee $R/tpdiag.txt ;;
    multigpu) log multigpu  # issue 6: needs the 2-GPU kind
      { nvidia-smi topo -m; lscpu | grep -iE "numa|socket|model name"; ls /sys/devices/system/node; } 2>&1 | tee $R/multi_gpu_topo.txt
      for p in tp hostpool pinned; do python3 -m profiling.bench.bench_multi_gpu --pool $p --out $R 2>&1 | tee -a $R/multi_gpu.log; done
      nn=$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)
      for ((k = 0; k < nn && nn > 1; k++)); do  # placement: the shared pool bound to each node in turn
        python3 -m profiling.bench.bench_multi_gpu --pool tp --numa-node $k --out $R/numa$k 2>&1 | tee -a $R/multi_gpu.log; done ;;
    stagedprobe) log stagedprobe  # host cost of staged H2D taken apart (probe_staged_h2d.py)
      for nb in ${KVO_PROBE_BLOCKS:-65536}; do
        python3 -m profiling.probes.probe_staged_h2d --blocks $nb --out $R/staged$nb 2>&1 | tee -a $R/staged_h2d_probe.txt; done ;;
    percall) log percall  # descriptors per batch call, both directions, taking turns (probe_staged_h2d.py --per-call)
      for bb in ${KVO_PERCALL_BB:-4096 32768}; do
        python3 -m profiling.probes.probe_staged_h2d --per-call --block-bytes $bb --blocks $((1073741824 / bb)) --out $R 2>&1 | tee -a $R/dma_per_call.txt; done ;;
    stagedstress) log stagedstress  # issue 37 item 4: phase S of the staged-fault repro (bit-exact, bounded) + memcheck on its small size
      { echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%FT%TZ), sha ${KVO_GIT_SHA:-unknown}"
        timeout 55 python3 -m profiling.probes.repro_staged_fault S; echo "S exit $?"
        timeout 60 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m profiling.probes.repro_staged_fault S --small 2>&1 | tail -12
        echo "memcheck exit ${PIPESTATUS[0]}"; echo "### kernel log (Xid)"; dmesg 2>&1 | grep -i xid | tail -5; } 2>&1 | tee $R/staged_stress.txt ;;
    stagedfault) log stagedfault  # the staged-H2D fault's repro, one process per run, by variant
      for v in ${KVO_FAULT_VARIANTS:-legacy side loop}; do for k in 1 2; do
        case $v in side) e="KVO_REPRO_STREAM=side";; loop) e="KVO_REPRO_DMA=loop";; *) e="";; esac
        echo "### $v run $k" >> $R/staged_fault.txt
        env $e timeout 120 python3 -m profiling.probes.repro_staged_fault ${KVO_FAULT_PHASE:-F} >> $R/staged_fault.txt 2>&1
        echo "### $v run $k: exit $?" | tee -a $R/staged_fault.txt
      done; done
      { echo "### kernel log (Xid)"; dmesg 2>&1 | grep -i xid | tail -20; } >> $R/staged_fault.txt 2>&1 ;;
    nsys) log nsys  # nsys from $NSYS or PATH (../shared/tools/nsys-on-device.sh says where it is on the device); needs .nsys-libs carried (../shared/tools/nsys-on-device.sh)
      export LD_LIBRARY_PATH=$PWD/.nsys-libs:${LD_LIBRARY_PATH:-}
      python3 -m profiling.analysis.profile_e2e --nsys --model 8b --prompt-len 8192 --requests 4 --out $R
      rm -f $R/e2e.sqlite ;;
    gputest) log gputest  # the GPU suite over 4 pytest workers, a file per worker (pytest-xdist --dist loadfile: the 8B-shape engine tests run one at a time; spread by test, they ran out of GPU memory together); correctness only, no timing
      echo "# GPU suite, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), sha ${KVO_GIT_SHA:-unknown}: pytest -n 4 --dist loadfile ${KVO_PYTEST_ARGS:-tests}" > $R/pytest.log
      python3 -m pytest -q -rs -n 4 --dist loadfile -p no:cacheprovider ${KVO_PYTEST_ARGS:-tests} ${KVO_PYTEST_K:+-k "$KVO_PYTEST_K"} 2>&1 \
        | tee -a $R/pytest.log | tail -25 ;;
    abortsan) log abortsan  # compute-sanitizer memcheck over the whole abort test file (issue 37); it runs kernels one
      # at a time, so a GPU read inside a held window waits for the gate: KVO_ABORT_SANITIZER=1 judges no in-window
      # observation and skips the negative controls (every case's paths still run to their final checks)
      echo "# compute-sanitizer memcheck on tests/test_gpu_abort_inflight.py, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), sha ${KVO_GIT_SHA:-unknown}" > $R/sanitizer_abort.log
      KVO_ABORT_SANITIZER=1 KVO_ABORT_GATE_MS=${KVO_ABORT_GATE_MS:-8000} timeout ${KVO_SAN_S:-480} compute-sanitizer --tool memcheck \
        --error-exitcode 3 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_abort_inflight.py >> $R/sanitizer_abort.log 2>&1
      echo "compute-sanitizer memcheck on test_gpu_abort_inflight: exit $?"; grep -E "ERROR SUMMARY|passed|failed" $R/sanitizer_abort.log | tail -n 3 ;;
    faultsan) log faultsan  # compute-sanitizer memcheck + racecheck on the fault-injection GPU tests (issue 37)
      echo "# compute-sanitizer on tests/test_gpu_faults.py, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), sha ${KVO_GIT_SHA:-unknown}" > $R/sanitizer_faults.log
      for tool in memcheck racecheck; do
        echo "### $tool" >> $R/sanitizer_faults.log
        timeout ${KVO_SAN_S:-200} compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 \
          python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_faults.py ${KVO_SAN_K:+-k "$KVO_SAN_K"} >> $R/sanitizer_faults.log 2>&1
        echo "compute-sanitizer $tool on test_gpu_faults: exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" $R/sanitizer_faults.log | tail -n 3
      done ;;
    integrity) log integrity  # integrity mode's cost: load GB/s at 2 MiB blocks with and without checksums
      python3 -m profiling.bench.bench_integrity --out $R/integrity.json 2>&1 | tail -20 ;;
    vllm-matrix) log vllm-matrix  # needs /tmp/vsite/env.sh sourced (../shared/tools/vllm-on-device): vLLM 0.26 + FA3
      # KVO_MATRIX_OUT: the results' name (default vllm_engine_check; e.g. vllm_engine_check_bf16 for a second matrix)
      mo=${KVO_MATRIX_OUT:-vllm_engine_check}
      python3 tests/vllm_engine_check.py --device cuda --out $R/$mo.json ${KVO_MATRIX_ARGS:-} 2>&1 | tee $R/$mo.txt | tail -30 ;;
    vllm-hybrid) log vllm-hybrid  # a hybrid model (full + sliding-window KV-cache groups) in vLLM 0.26, both routes (same env as vllm-matrix)
      python3 tests/vllm_hybrid_check.py --device cuda --out $R/vllm_hybrid_check.json ${KVO_HYBRID_ARGS:-} 2>&1 | tee $R/vllm_hybrid_check.txt | tail -30 ;;
    vllm-tests) log vllm-tests  # the GPU tests that need vLLM (same env as vllm-matrix)
      # the abort tests' gates hold a stream 4 s (not 1.5): this step often shares the machine with
      # engines, and a gate that runs out before the host-side checks makes a test refuse, not pass
      export KVO_ABORT_GATE_MS=${KVO_ABORT_GATE_MS:-4000}
      echo "# GPU tests with vLLM, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), sha ${KVO_GIT_SHA:-unknown}" > $R/pytest_vllm.log
      python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm_conformance.py tests/test_vllm_tp.py tests/test_vllm_store_failure_unit.py \
        tests/test_gpu_faults.py tests/test_gpu_abort_inflight.py tests/test_layers_once.py 2>&1 \
        | tee -a $R/pytest_vllm.log | tail -8 ;;
    vllm-memcheck) log vllm-memcheck  # compute-sanitizer memcheck over one short in-process vLLM run with our connector
      timeout ${KVO_MEMCHECK_S:-300} compute-sanitizer --tool memcheck --target-processes all --error-exitcode 3 \
        python3 tests/vllm_engine_check.py --device cuda --configs conn-native --inproc --out $R/vllm_memcheck.json \
        > $R/vllm_memcheck.log 2>&1; echo "memcheck exit $?"; grep -E "ERROR SUMMARY|PASS|FAIL" $R/vllm_memcheck.log | tail -5 ;;
    soak) log soak  # issue 37's soak inside vLLM 0.26, integrity on (profiling/bench/soak_vllm.py): KVO_SOAK_S s offloaded
      # (default 480 = 8 min; the no-offload baseline runs beside it in its own process), then the negative
      # controls (corrupt, corrupt_integrity); fp32 + Triton attention (bf16 FA3 flips exact ties under
      # preemption, docs/vllm.md). Whole run bounded by --time-limit = KVO_SOAK_S + 90 (570 s; ~550 s expected);
      # KVO_SOAK_ARGS come last and override (e.g. "--dtype bfloat16 --backend FA3", "--controls=" for none)
      ss=${KVO_SOAK_S:-480}
      timeout -k 5 $((ss + 105)) python3 -m profiling.bench.soak_vllm --duration $ss --time-limit $((ss + 90)) \
        --dtype float32 --backend TRITON_ATTN ${KVO_SOAK_ARGS:-} --out $R/soak_vllm.json 2>&1 | tee $R/soak_vllm.txt | tail -40 ;;
    vllm-bench) log vllm-bench  # the head-to-head inside vLLM 0.26 (profiling/bench/bench_vllm.py)
      python3 -m profiling.bench.bench_vllm --out $R/vllm.json ${KVO_VLLM_BENCH_ARGS:-} 2>&1 | tee $R/vllm_bench.txt | tail -40 ;;
  esac
  tar -czf $OUT/results.tgz -C $R .
done
log done

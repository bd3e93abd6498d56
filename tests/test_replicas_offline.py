"""`DataParallelLLM` (pagedllm/replicas/offline.py) on a two-node local Ray cluster of its own
(the server tests' replicas hold that module's cluster's CPUs)."""

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster


def test_offline_generate_spreads_prompts_over_replicas_and_keeps_their_order(cluster):
    """`DataParallelLLM` on the two-node cluster gives what one `LLM` gives, prompt for prompt
    (float32, greedy), with prompts that share a prefix kept on one replica.  The weights are
    dequantized: on the GGUF blocks a step's row count picks the kernel (integer kernels on
    8-bit activations, or a float GEMM), so a prompt's tokens may depend on which prompts share
    its replica, which is not what this test is about."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.replicas.offline import DataParallelLLM

    shared = list(range(1000, 1064))  # four blocks of 16
    prompts = [shared + [2000 + i] for i in range(6)] + [[3000 + i, 3001, 3002] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine_args = dict(dtype="float32", kv_cache_memory="64MiB", weights="dequantized")
    parallel = DataParallelLLM(data_parallel_size=2, ray_address=cluster.address, **engine_args)
    try:
        got = parallel.generate(prompts, params)
    finally:
        parallel.shutdown()
    expected = LLM(**engine_args).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.prompt_token_ids for o in got] == prompts

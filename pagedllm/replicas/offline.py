"""The `LLM` API over data-parallel replicas, for offline batch work: a list of prompts
spread over N engines (Ray actors, each an `LLM` of its own), the outputs back in the
prompts' order.

Prompts are placed by the same router as the server's (pagedllm/replicas/router.py), from
their token ids: prompts that share leading blocks go to one replica, where they share its
prefix cache, as far as the balance rule allows.  Each replica then runs its share as one
batch.  A replica that dies fails `generate` with an error naming it (nothing is retried
offline: the caller decides); Ray restarts it for the next call.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pagedllm.core.outputs import RequestOutput
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.llm import prompts_and_params
from pagedllm.replicas.router import Router


class _Replica:
    """The body of one replica actor: an LLM pinned to its share of the cores."""

    def __init__(self, model: str | None, cores: int, pin: list[int] | None, engine_args: dict) -> None:
        if pin:
            os.sched_setaffinity(0, pin)
        from pagedllm.llm import LLM

        self.llm = LLM(model, num_threads=cores, **engine_args)

    def token_ids(self, prompts: list) -> list[list[int]]:
        return [p if isinstance(p, list) else self.llm.engine.tokenizer.encode(p) for p in prompts]

    def block_size(self) -> int:
        return self.llm.engine.info.block_size

    def generate(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        return self.llm.generate(prompts, params, use_tqdm=False)


class DataParallelLLM:
    """`DataParallelLLM(model, data_parallel_size=2, ...)`: as `LLM(model, ...)`, on N replicas."""

    def __init__(
        self,
        model: str | None = None,
        data_parallel_size: int = 2,
        ray_address: str | None = None,
        router: str = "prefix",
        start_timeout: float = 600.0,
        **engine_args,
    ) -> None:
        try:
            import ray
        except ImportError as error:
            raise ValueError("DataParallelLLM needs Ray: pip install 'ray>=2.40'") from error
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}")
        machine_cores = sorted(os.sched_getaffinity(0))
        cores = max(1, len(machine_cores) // data_parallel_size)
        if not ray.is_initialized():
            if ray_address is None:
                ray.init(num_cpus=max(len(machine_cores), cores * data_parallel_size), include_dashboard=False)
            else:
                ray.init(address=ray_address)
        actor = ray.remote(num_cpus=cores, max_restarts=-1)(_Replica)
        local = ray_address is None
        self.replicas = []
        for i in range(data_parallel_size):
            pin = (
                machine_cores[i * cores : (i + 1) * cores] if local and (i + 1) * cores <= len(machine_cores) else None
            )
            self.replicas.append(actor.remote(model, cores, pin, engine_args))
        try:
            self.block_size = ray.get([r.block_size.remote() for r in self.replicas], timeout=start_timeout)[0]
        except ray.exceptions.GetTimeoutError as error:
            self.shutdown()
            free = ray.available_resources().get("CPU", 0)
            raise RuntimeError(
                f"{data_parallel_size} replicas of {cores} CPUs were not all up within {start_timeout:.0f} s "
                f"(Ray has {free:g} CPUs free)"
            ) from error
        self.router_policy = router

    def generate(
        self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """One output per prompt, in the prompts' order (text or token ids, as `LLM.generate`)."""
        import ray

        prompts, params = prompts_and_params(prompts, params)
        if not prompts:
            return []
        ids = ray.get(self.replicas[0].token_ids.remote(prompts))
        # Offline, load is each replica's share so far: shared prefixes stay together until a
        # replica has a quarter of an even share more than the least loaded one.
        imbalance = max(1, len(prompts) // (4 * len(self.replicas)))
        router = Router(len(self.replicas), self.block_size, self.router_policy, max_imbalance=imbalance)
        shares: list[list[int]] = [[] for _ in self.replicas]
        for index, token_ids in enumerate(ids):
            shares[router.route(token_ids).replica].append(index)
        pending = {
            i: self.replicas[i].generate.remote([prompts[j] for j in share], [params[j] for j in share])
            for i, share in enumerate(shares)
            if share
        }
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        for i, ref in pending.items():
            try:
                results = ray.get(ref)
            except ray.exceptions.RayActorError as error:
                raise RuntimeError(
                    f"replica {i} died while generating its {len(shares[i])} prompts: {error}"
                ) from error
            for j, output in zip(shares[i], results):
                outputs[j] = output
        return outputs

    def shutdown(self) -> None:
        import ray

        for replica in self.replicas:
            ray.kill(replica, no_restart=True)
        self.replicas = []

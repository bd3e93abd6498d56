"""The engine: requests in, a step loop (schedule, run, update), outputs out.

- llm_engine.py: `LLMEngine`, built once per model; its `step` is the loop.
- intake.py: requests checked and turned into sequences (samples forked, beams started).
- output_processor.py: a step's sampled tokens applied: failures isolated to their request,
  beams advanced, text detokenized, outputs assembled.
- request_table.py: which request each running sequence belongs to.
- state.py: what the outside reads (`EngineInfo`, `/stats`, the dashboard, a run's figures),
  read from the engine's parts here so that no module outside engine/ reaches into them.
"""

from pagedllm.engine.llm_engine import MAX_FAILED_STEPS, EngineStats, EngineStepError, LLMEngine
from pagedllm.engine.state import EngineInfo, RunCounters

__all__ = ["MAX_FAILED_STEPS", "EngineInfo", "EngineStats", "EngineStepError", "LLMEngine", "RunCounters"]

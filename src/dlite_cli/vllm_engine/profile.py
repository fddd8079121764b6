"""``dlite profile`` inside vLLM: the passes dlite's engine is timed at (profile.py), timed from inside vLLM.

vLLM runs in this process (engine core and worker), on a checkpoint of the profile's target shapes with random
weights (``load_format="dummy"``: nothing downloaded or written but its config), drafting through dlite's plugin
with a random DLite drafter of the config's shape, proposing all K every step (``:fixed``), cut here to the width
being timed.  Per engine step, at batch B after a context of C tokens:

    forward   vLLM's model forward (``GPUModelRunner._model_forward``): the target's pass over the step's tokens
    draft     the plugin's draft round (``DLiteProposer.propose``)
    step      ``LLMEngine.step()`` whole: scheduling, the forward, sampling and rejection, the draft, the outputs'
              way back; ``step − forward − draft`` is vLLM's host time per step

Random drafts are rejected, so every step commits one token a row and passes 1 + (width − 1) tokens a row; widths
above K + 1 cannot be proposed and are left out.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from ..models.model import Drafter
from .engine import import_vllm

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
WARMUP_STEPS = 2


class StepTimes:
    """Hooks on vLLM's model runner and dlite's proposer: the ms and tokens of each model forward and the ms of each
    draft round since :meth:`clear`, with every proposal cut to ``width`` − 1 tokens."""

    def __init__(self, runner_class, proposer):
        self.width, self.forward, self.draft = 1, [], []
        forward, propose = runner_class._model_forward, proposer.propose

        def timed_forward(runner, *args, **kwargs):
            start = time.perf_counter()
            out = forward(runner, *args, **kwargs)
            self.forward.append((1000 * (time.perf_counter() - start), int(kwargs["positions"].shape[-1])))
            return out

        def cut_propose(*args):
            start = time.perf_counter()
            drafts, q = propose(*args)
            self.draft.append(1000 * (time.perf_counter() - start))
            return [d[: self.width - 1] for d in drafts], q

        self.restore = lambda: (setattr(runner_class, "_model_forward", forward), delattr(proposer, "propose"))
        runner_class._model_forward = timed_forward
        proposer.propose = cut_propose

    def clear(self) -> None:
        self.forward.clear()
        self.draft.clear()


def profile_vllm(arch, spec, dtype: str, plan, settings, log=print) -> dict:
    """vLLM's forward, draft and host ms per step at every (batch, context, width ≤ K + 1) of ``plan`` (profile.ProfilePlan),
    median of ``plan.repeats`` steps; ``settings``: the config's vllm section (enforce_eager, kv_cache_gib)."""
    vllm = import_vllm()
    from vllm.v1.worker import gpu_model_runner

    K = spec.draft_tokens
    widths = [w for w in plan.widths if w <= K + 1]
    steps = WARMUP_STEPS + plan.repeats
    longest = max(plan.contexts) + (steps + 2) * (K + 1)
    saved = {name: os.environ.get(name) for name in IN_PROCESS}
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = Path(tmp) / "target", Path(tmp) / "drafter"
        target.mkdir()
        (target / "config.json").write_text(arch.to_json_string())
        Drafter(spec).save(drafter)
        os.environ.update(IN_PROCESS)
        try:
            log(f"profiling vLLM {vllm.__version__} in this process (random weights, {dtype})")
            llm = vllm.LLM(model=str(target), load_format="dummy", skip_tokenizer_init=True, dtype=dtype, seed=0, max_model_len=longest,
                           enforce_eager=settings.enforce_eager, kv_cache_memory_bytes=int(settings.kv_cache_gib * 2**30),
                           distributed_executor_backend="uni", speculative_config={"model": f"{drafter}:fixed"})
        finally:
            for name, value in saved.items():
                os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
        engine = llm.llm_engine
        runner = engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        times, cells = StepTimes(gpu_model_runner.GPUModelRunner, runner.drafter), []
        try:
            for batch in plan.batches:
                for context in plan.contexts:
                    for width in widths:
                        times.width = width
                        cells.append({"batch": batch, "context": context, "tokens": width,
                                      **_timed_steps(vllm, engine, times, batch, context, steps, arch.vocab_size)})
        finally:
            times.restore()
        del llm
    return {"version": vllm.__version__, "dtype": dtype, "enforce_eager": settings.enforce_eager, "passes": cells}


def _timed_steps(vllm, engine, times: StepTimes, batch: int, context: int, steps: int, vocab: int) -> dict:
    """``batch`` requests of ``context`` random tokens decoded for ``steps`` steps → the median forward, draft, step and host
    ms of the steps that passed ``batch × width`` tokens (no prefill), after the first WARMUP_STEPS of them."""
    import torch

    params = vllm.SamplingParams(max_tokens=(steps + 2) * times.width, temperature=0, ignore_eos=True)  # a step commits ≤ width
    ids = [f"profile-{batch}-{context}-{times.width}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        prompt = torch.randint(vocab, (context,), generator=torch.Generator().manual_seed(i)).tolist()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    measured = []  # (forward, draft, step) ms
    while engine.has_unfinished_requests() and len(measured) < steps:
        times.clear()
        start = time.perf_counter()
        engine.step()
        step = 1000 * (time.perf_counter() - start)
        if [tokens for _, tokens in times.forward] == [batch * times.width]:
            measured.append((times.forward[0][0], sum(times.draft), step))
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    measured = measured[WARMUP_STEPS:] or measured
    forward, draft, step = (statistics.median(column) for column in zip(*measured))
    host = statistics.median(s - f - d for f, d, s in measured)
    return {"forward_ms": round(forward, 3), "draft_ms": round(draft, 3), "step_ms": round(step, 3), "host_ms": round(host, 3), "steps": len(measured)}

"""``dlite generate``: one prompt decoded with speculative decoding, in vLLM or dlite's own engine; its text and
acceptance statistics."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.config import Config
from ..decoding.engine import load_engine
from ..decoding.engines import open_engine
from ..decoding.requests import Request, SamplingParams
from ..models.chat import chat_prompt_ids
from ..models.targets import load_tokenizer, prepare_target


def decoding_engine(config: Config, run_dir: Path, drafter: str, setting: str | None, max_new_tokens: int, log):
    """The engine for ``setting`` (auto, vllm or dlite; None: decode.engine) → (engine, tokenizer, its name), opened as
    decoding/engines.open_engine does."""

    def in_vllm():
        from ..vllm_engine.engine import load_vllm_engine

        return load_vllm_engine(config, run_dir, drafter, log), load_tokenizer(prepare_target(config.target, log)), "vllm"

    def in_dlite():
        return *load_engine(config, run_dir, drafter, slots=1, log=log, response_tokens=max_new_tokens), "dlite"

    return open_engine(config, setting, in_vllm, in_dlite, log)


def generate(config: Config, run_dir: Path, text: str, drafter: str, params: SamplingParams, raw: bool, as_json: bool, setting: str | None, log) -> None:
    """Decode ``text`` (a user message in the chat template, or ``raw`` as it is) and print the text, or with
    ``as_json`` one JSON object holding it and every statistic; the statistics' line goes to ``log``."""
    decoder, tokenizer, engine = decoding_engine(config, run_dir, drafter, setting, params.max_new_tokens, log)
    if raw:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": text}], config.target.thinking)
    (request,) = decoder.run([Request(ids, params)])
    stats = request.stats.as_dict()
    if as_json:
        print(json.dumps({"text": request.text, "finish_reason": request.finish_reason, "drafter": drafter, "engine": engine, **stats}))
        return
    print(request.text)
    acceptance = " ".join("-" if a is None else f"{a:.2f}" for a in stats["acceptance"])
    # vLLM does not split a step into draft and verify
    rounds = ("" if engine == "vllm" else f"per round: draft {stats['draft_ms_per_round']:.1f} ms, verify {stats['verify_ms_per_round']:.1f} ms, "
              f"other {stats['overhead_ms_per_round']:.1f} ms; ")
    where = "vLLM" if engine == "vllm" else "dlite's engine"
    log(f"{drafter} in {where}: tau {stats['tau']:.2f} over {stats['rounds']} rounds, {stats['generated_tokens']} tokens "
        f"({request.finish_reason}); prefill {stats['prefill_ms']:.0f} ms for {stats['prompt_tokens']} tokens; {rounds}"
        f"acceptance by position: {acceptance or 'n/a'}; {stats['generated_tokens'] / max(stats['decode_seconds'], 1e-9):.1f} tok/s")

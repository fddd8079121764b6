"""``dlite serve``: an OpenAI-compatible HTTP server whose requests share the engine's continuous batch, in vLLM's
server or dlite's own; this module loads the engine and serves until interrupted.

dlite's own server: the protocol's request bodies (bodies.py), the worker thread that owns the Engine (worker.py),
and the HTTP app, its routes and responses (app.py).
"""

from __future__ import annotations

import logging

from .app import create_app

logger = logging.getLogger("dlite.serve")


def serve(config, run_dir, drafter: str, host: str, port: int, max_batch: int | None, max_queue: int, max_context: int | None,
          max_tokens: int, engine: str | None, log) -> None:
    """Load the target and drafter, then serve until interrupted: in the engine ``engine`` names (None: decode.engine;
    auto: vLLM where it is installed and can draft with the drafter), vLLM's OpenAI server or dlite's own."""
    from ..decoding.engines import open_engine

    def in_vllm():
        from ..vllm_engine.engine import serve_vllm

        serve_vllm(config, run_dir, drafter, host, port, max_batch or config.decode.max_batch, max_queue, max_context, max_tokens, log)

    open_engine(config, engine, in_vllm, lambda: serve_dlite(config, run_dir, drafter, host, port, max_batch, max_queue, max_context, max_tokens, log), log)


def serve_dlite(config, run_dir, drafter: str, host: str, port: int, max_batch: int | None, max_queue: int, max_context: int | None,
                max_tokens: int, log) -> None:
    """dlite's own server (:func:`create_app`) on ``host``:``port`` until interrupted."""
    import uvicorn

    from ..decoding.engine import load_engine

    decoder, tokenizer = load_engine(config, run_dir, drafter, slots=max_batch, capacity=max_context, log=log, response_tokens=max_tokens)
    app = create_app(decoder, tokenizer, config.name, config.target.thinking, max_queue, max_tokens)
    handler = logging.StreamHandler()  # the server's warnings (ignored fields) and failures, with their tracebacks
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    log(f"serving {config.name} with drafter {drafter} ({len(decoder.free)} slots, context {decoder.capacity}, "
        f"{decoder.runner.path} decoding on {decoder.runner.device}) "
        f"on http://{host}:{port}/v1")
    uvicorn.run(app, host=host, port=port, log_level="warning")

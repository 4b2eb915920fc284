"""transformers' model API on genkit's native models (issue 30, item 1), checked against
transformers on the same weights: files written by ``save_pretrained`` (and pushed to the test Hub)
load in both libraries, forward outputs behave like ``ModelOutput``, and ``labels``, 4-D masks,
``logits_to_keep`` and ``output_attentions`` give what transformers gives."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
from hub_server import hub_server  # noqa: F401
from tolerance import hidden_bound, logits_bound, matmul_bound
from windowed_model import windowed_mistral

import genkit
from genkit.errors import ConfigError, NotSupportedError
from genkit.models.gpt2 import GPT2LMHeadModel
from genkit.models.llama import LlamaForCausalLM
from genkit.models.outputs import CausalLMOutput

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 17, 42, 7, 9], [1, 99, 3, 64, 5]])


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(vocab_size=160, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                  bos_token_id=1, eos_token_id=2)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    path = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(path)
    return hf, genkit.load_model(path)


def _greedy(model, n=6):
    return model.generate(IDS, max_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_save_pretrained_loads_in_transformers_and_genkit(arch, tiny_pair, gpt2_pair, tmp_path):
    hf, ours = tiny_pair if arch == "llama" else gpt2_pair
    _greedy(ours)  # after a generation: the weights are laid out for the inference path
    ours.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__] and config["dtype"] == "float32"
    back_hf = type(hf).from_pretrained(tmp_path / "saved").eval()
    back_ours = genkit.load_model(tmp_path / "saved")
    assert torch.equal(back_hf(IDS).logits, hf(IDS).logits)
    assert torch.equal(back_ours(IDS).logits, ours(IDS).logits)
    assert torch.equal(_greedy(back_ours), _greedy(hf))
    if arch == "gpt2":  # the tied LM head is written once, under the embedding's name
        from safetensors import safe_open

        with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as fh:
            assert "lm_head.weight" not in fh.keys() and "transformer.wte.weight" in fh.keys()


def test_push_to_hub_round_trip(tiny_pair, hub_server, tmp_path):  # noqa: F811
    hf, ours = tiny_pair
    info = ours.push_to_hub("org/tiny-llama", commit_message="from genkit")
    assert len(info.oid) == 40
    pulled = LlamaForCausalLM.from_pretrained("org/tiny-llama")
    assert torch.equal(_greedy(pulled), _greedy(hf))
    assert torch.equal(transformers.LlamaForCausalLM.from_pretrained("org/tiny-llama")(IDS).logits, hf(IDS).logits)
    ours.save_pretrained(tmp_path / "again", push_to_hub=True, repo_id="org/tiny-llama-2")
    assert torch.equal(genkit.load_model("org/tiny-llama-2")(IDS).logits, ours(IDS).logits)


def test_from_pretrained_checks_the_class_and_arguments(tiny_hf_dir, tiny_pair):
    model = LlamaForCausalLM.from_pretrained(tiny_hf_dir, torch_dtype=torch.bfloat16)
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"holds a LlamaForCausalLM, not a GPT2LMHeadModel"):
        GPT2LMHeadModel.from_pretrained(tiny_hf_dir)
    with pytest.raises(ConfigError, match=r"from_pretrained: unknown argument\(s\) \['nonsense'\]"):
        LlamaForCausalLM.from_pretrained(tiny_hf_dir, nonsense=1)
    with pytest.raises(NotSupportedError, match="safe_serialization=False"):
        tiny_pair[1].save_pretrained("/tmp/unused", safe_serialization=False)


def test_num_parameters_flags_and_from_config(tiny_pair, gpt2_pair):
    for hf, ours in (tiny_pair, gpt2_pair):
        assert ours.num_parameters() == hf.num_parameters()
        assert ours.num_parameters(exclude_embeddings=True) == hf.num_parameters(exclude_embeddings=True)
        assert ours.num_parameters(only_trainable=True) == hf.num_parameters(only_trainable=True)
        assert ours.can_generate() and type(ours).can_generate() and ours.main_input_name == "input_ids"
        assert (ours._is_stateful, ours._supports_sdpa, ours._can_compile_fullgraph) == (False, True, False)
        fresh = type(ours)._from_config(hf.config, dtype=torch.float16)
        assert fresh.dtype == torch.float16 and fresh.num_parameters() == hf.num_parameters()
        assert {n: p.shape for n, p in fresh.named_parameters()} == {n: p.shape for n, p in ours.named_parameters()}
    with pytest.raises(NotSupportedError, match="attn_implementation"):
        LlamaForCausalLM._from_config(tiny_pair[0].config, attn_implementation="flash_attention_2")


def test_forward_output_is_model_output_like(tiny_model):
    out = tiny_model(IDS)
    assert isinstance(out, CausalLMOutput)
    assert "past_key_values" in out and "loss" not in out and "attentions" not in out
    assert list(out.keys()) == ["logits", "past_key_values"]
    assert out[0] is out.logits and out["logits"] is out.logits and out.to_tuple() == (out.logits, out.past_key_values)
    with pytest.raises(KeyError):
        out["loss"]
    logits, cache = tiny_model(IDS, return_dict=False)
    assert torch.equal(logits, out.logits) and cache.get_seq_length() == 5
    out.logits = out.logits * 2
    assert out["logits"] is out.logits
    assert list(copy.copy(out).keys()) == ["logits", "past_key_values"]
    assert list(pickle.loads(pickle.dumps(tiny_model(IDS, use_cache=False))).keys()) == ["logits"]


def test_labels_give_transformers_loss(tiny_pair, gpt2_pair):
    for hf, ours in (tiny_pair, gpt2_pair):
        labels = IDS.clone()
        labels[0, :2] = -100
        with torch.enable_grad():
            ours_loss = ours(IDS, labels=labels).loss
        assert ours_loss.requires_grad
        torch.testing.assert_close(ours_loss, hf(IDS, labels=labels).loss)
        torch.testing.assert_close(ours(IDS, labels=IDS, num_items_in_batch=7).loss,
                                   hf(IDS, labels=IDS, num_items_in_batch=7).loss)


def test_four_d_masks_logits_to_keep_and_attentions_match_transformers(tiny_hf_dir, tiny_pair, gpt2_pair, tmp_path):
    hf_eager = transformers.LlamaForCausalLM.from_pretrained(tiny_hf_dir, attn_implementation="eager").eval()
    _, ours = tiny_pair
    gpt2_hf, gpt2 = gpt2_pair
    gpt2_hf.set_attn_implementation("eager")
    # a block-diagonal mask: two packed sequences of 2 and 3 tokens in one row
    allowed = torch.zeros(5, 5, dtype=torch.bool)
    allowed[:2, :2] = torch.tril(torch.ones(2, 2, dtype=torch.bool))
    allowed[2:, 2:] = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    additive = torch.zeros(2, 1, 5, 5).masked_fill(~allowed, torch.finfo(torch.float32).min)
    positions = torch.tensor([[0, 1, 0, 1, 2]] * 2)
    for hf, model in ((hf_eager, ours), (gpt2_hf, gpt2)):
        want = hf(IDS, attention_mask=additive, position_ids=positions).logits
        torch.testing.assert_close(model(IDS, attention_mask=additive, position_ids=positions).logits, want)
        torch.testing.assert_close(model(IDS, attention_mask=allowed[None, None].expand(2, 1, 5, 5),
                                         position_ids=positions).logits, want)
        torch.testing.assert_close(model(IDS, logits_to_keep=2).logits, hf(IDS, logits_to_keep=2).logits)
        mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
        pos = torch.tensor([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]])  # as genkit counts them, given to both
        got = model(IDS, attention_mask=mask, position_ids=pos, output_attentions=True)
        ref = hf(IDS, attention_mask=mask, position_ids=pos, output_attentions=True)
        assert len(got.attentions) == len(ref.attentions) == 2
        for a, b in zip(got.attentions, ref.attentions):
            torch.testing.assert_close(a[:, :, 1:], b[:, :, 1:])  # real query rows (padded rows differ by design)
            torch.testing.assert_close(a[1], b[1])
        torch.testing.assert_close(got.logits[:, 1:], model(IDS, attention_mask=mask).logits[:, 1:])
    with pytest.raises(ConfigError, match=r"a 4-D `attention_mask` must be \(batch, 1, query length, key length\)"):
        ours(IDS, attention_mask=additive[:, :, :4])


def test_transformers_cache_in_the_native_forward(tiny_pair):
    hf, ours = tiny_pair
    cache = transformers.DynamicCache(config=hf.config)
    first = ours(IDS[:, :3], past_key_values=cache)
    assert first.past_key_values is cache and cache.get_seq_length() == 3
    step = ours(IDS[:, 3:], past_key_values=cache)
    torch.testing.assert_close(step.logits, hf(IDS).logits[:, 3:])
    # genkit's generate on a native model with a transformers cache: the tokens of a fresh generation
    fresh = transformers.DynamicCache(config=hf.config)
    out = genkit.generate(ours, IDS, max_new_tokens=5, past_key_values=fresh, return_dict_in_generate=True)
    assert out.past_key_values is fresh and fresh.get_seq_length() == IDS.shape[1] + 4
    assert torch.equal(out.sequences, genkit.generate(ours, IDS, max_new_tokens=5))


def test_generate_returns_transformers_output_classes(tiny_pair):
    """With transformers loaded, generate's dict outputs are transformers' classes and genkit's at
    once, genkit's extra fields kept; the cache reads under both names."""
    from genkit.strategy import outputs as ours_outputs

    hf, ours = tiny_pair
    for kw, name in (({}, "GenerateDecoderOnlyOutput"), ({"num_beams": 2}, "GenerateBeamDecoderOnlyOutput")):
        out = ours.generate(IDS, max_new_tokens=3, return_dict_in_generate=True, output_scores=True, **kw)
        ref = hf.generate(IDS, max_new_tokens=3, return_dict_in_generate=True, output_scores=True, **kw)
        assert isinstance(out, getattr(transformers.generation, name)) and isinstance(out, getattr(ours_outputs, name))
        assert isinstance(out, transformers.utils.ModelOutput) and type(out).__name__ == name
        assert torch.equal(out.sequences, ref.sequences) and out["sequences"] is out.sequences
        assert out.past_key_values is out.cache and "cache" in out and len(out.scores) == 3
    out = ours.generate(IDS, max_new_tokens=3, return_dict_in_generate=True)
    assert out.finish_reasons == ["length", "length"] and out.to_tuple()[0] is out.sequences


def test_prepare_inputs_for_generation_drives_a_greedy_loop(tiny_pair):
    """A greedy loop written against transformers 5's prepare_inputs_for_generation, run on the
    native model, gives transformers' greedy tokens; the config and cache read as transformers'."""
    hf, ours = tiny_pair
    mask = torch.ones_like(IDS)
    mask[0, :2] = 0
    seqs, cache, new = IDS, None, None
    for step in range(4):
        inputs = ours.prepare_inputs_for_generation(seqs, next_sequence_length=new, cache=cache, attention_mask=mask,
                                                    is_first_iteration=step == 0, use_cache=True, labels=IDS)
        assert "labels" not in inputs and (step == 0 or inputs["input_ids"].shape == (2, 1))
        out = ours(**inputs)
        cache, new = out.past_key_values, 1
        seqs = torch.cat([seqs, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    ref = hf.generate(IDS, attention_mask=mask[:, :IDS.shape[1]], max_new_tokens=4, do_sample=False)
    assert torch.equal(seqs, ref)
    assert [k.shape for k in cache.key_cache] == [(2, 2, 8, 16)] * 2 and len(cache.value_cache) == 2
    assert ours.config.get_text_config(decoder=True) is ours.config and not hasattr(ours.config, "text_config")
    assert "GenerationMixin" in str(LlamaForCausalLM.__bases__) and "GenerationMixin" in str(GPT2LMHeadModel.__bases__)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_attn_implementation_eager_is_honoured(arch, tiny_hf_dir, tiny_pair, gpt2_pair, tmp_path):
    """attn_implementation="eager" computes attention step by step as transformers' eager does (the
    logits of the eager forward that returns the weights, and transformers' eager model's logits);
    "sdpa" is the default; anything else, and continuous batching on an eager model, are refused."""
    hf, ours = tiny_pair if arch == "llama" else gpt2_pair
    ours.save_pretrained(tmp_path / "m")
    cls = type(ours)

    class Sub(cls):  # a user's subclass gets an instance of itself, as in transformers
        def greet(self):
            return "hi"

    eager = Sub.from_pretrained(tmp_path / "m", attn_implementation="eager", low_cpu_mem_usage=True)
    assert isinstance(eager, Sub) and eager.greet() == "hi" and eager.attn_implementation == "eager"
    assert cls.from_pretrained(tmp_path / "m").attn_implementation == "sdpa"
    hf_eager = type(hf).from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    with torch.no_grad():
        logits = eager(IDS).logits
        assert torch.equal(logits, eager(IDS, output_attentions=True).logits)
        torch.testing.assert_close(logits, hf_eager(IDS).logits, rtol=1e-5, atol=1e-5)
    assert eager(IDS).attentions is None
    assert torch.equal(eager.generate(IDS, max_new_tokens=5, do_sample=False), _greedy(hf, 5))
    with pytest.raises(NotSupportedError, match="attn_implementation"):
        eager.set_attn_implementation("flash_attention_2")
    with pytest.raises(ConfigError, match="low_cpu_mem_usage"):
        cls.from_pretrained(tmp_path / "m", low_cpu_mem_usage=False)
    if arch == "llama":
        with pytest.raises(NotSupportedError, match="attn_implementation='eager'"):
            eager.generate(IDS, max_new_tokens=2, cache_implementation="paged")


def test_transformers_5_24_cache_names_and_cache_position_on_the_native_forward(tiny_pair):
    """transformers 5.24 passes the cache as `cache=` and returns it as `.cache`; code written for
    transformers 4 passes `cache_position`. The native forward reads each as transformers does (the
    logits of transformers' incremental forward), and refuses a `cache_position` that is not the
    cache's next positions, or both cache names at once."""
    hf, ours = tiny_pair
    hf_cache, cache = transformers.DynamicCache(config=hf.config), transformers.DynamicCache(config=hf.config)
    hf(IDS[:, :3], cache=hf_cache, cache_position=torch.arange(3))
    ref = hf(IDS[:, 3:], cache=hf_cache, cache_position=torch.arange(3, 5)).logits
    first = ours(IDS[:, :3], cache=cache, cache_position=torch.arange(3))
    assert first.cache is cache and first.past_key_values is cache and cache.get_seq_length() == 3
    step = ours(IDS[:, 3:], cache=first.cache, cache_position=torch.arange(3, 5))
    bound = logits_bound(ours, IDS)
    assert (step.logits - ref).abs().max() <= bound
    native = ours(IDS[:, :3]).cache  # genkit's own cache, under the new name too
    assert (ours(IDS[:, 3:], cache=native).logits - ref).abs().max() <= bound
    with pytest.raises(ConfigError, match=r"pass `cache` or `past_key_values` \(its old name\), not both"):
        ours(IDS, cache=native, past_key_values=native)
    with pytest.raises(ConfigError, match=r"`cache_position` must be the positions after the cache's, "
                                          r"torch.arange\(3, 5\) here .*; got \[0, 1\]"):
        ours(IDS[:, 3:], cache=ours(IDS[:, :3]).cache, cache_position=torch.arange(2))
    # use_cache=None reads the config, as in transformers
    assert ours(IDS, use_cache=None).cache is not None and hf(IDS, use_cache=None).cache is not None
    out = ours(IDS)
    out.cache = None
    assert list(out.keys()) == ["logits"] and out.past_key_values is None


def test_native_cache_answers_transformers_cache_methods(tiny_pair):
    """genkit's KVCache (what the native forward returns) under transformers' Cache method names:
    `update(key_states, value_states, layer_idx)`, `reorder_cache`, `batch_select_indices`,
    `batch_repeat_interleave`, `crop(-n)`; each leaves the cache as the same call leaves transformers'
    DynamicCache filled by transformers' model on the same prompt."""
    hf, ours = tiny_pair
    mine, theirs = ours(IDS).cache, hf(IDS).cache
    bound = logits_bound(ours, IDS)

    def same():
        assert mine.get_seq_length() == theirs.get_seq_length()
        for layer in range(hf.config.num_hidden_layers):
            for a, b in zip(mine[layer], (theirs.layers[layer].keys, theirs.layers[layer].values)):
                assert a.shape == b.shape and (a - b).abs().max() <= bound

    same()
    index = torch.tensor([1, 0])
    mine.reorder_cache(index), theirs.reorder_cache(index)
    same()
    mine.batch_repeat_interleave(2), theirs.batch_repeat_interleave(2)
    same()
    mine.batch_select_indices(torch.tensor([0, 3])), theirs.batch_select_indices(torch.tensor([0, 3]))
    same()
    mine.crop(-2), theirs.crop(-2)
    same()
    k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    got, want = mine.update(k, v, 1), theirs.update(k, v, 1)
    assert all(torch.equal(a[:, :, -1:], b[:, :, -1:]) for a, b in zip(got, want))
    assert [a.shape for a in got] == [b.shape for b in want] == [(2, 2, 4, 16)] * 2


def test_native_forward_writes_transformers_sliding_window_and_static_caches(tmp_path):
    """transformers' caches whose layers hand back other than one key per position seen --
    `DynamicCache(config=...)` of a sliding-window model (the window's positions only), `StaticCache`
    (its whole buffer) -- written by the native forward give transformers' logits on a prompt longer
    than the window, and genkit's generate on them transformers' tokens."""
    config, hf, ours = windowed_mistral(tmp_path / "mistral")
    ids = torch.randint(3, 128, (2, 12))
    bound = logits_bound(ours, ids)
    for make in (lambda: transformers.DynamicCache(config=config),
                 lambda: transformers.StaticCache(config=config, max_cache_len=16)):
        mine, theirs = make(), make()
        for part in (ids[:, :9], ids[:, 9:11], ids[:, 11:]):  # a prefill past the window, then steps
            got, want = ours(part, cache=mine).logits, hf(part, cache=theirs).logits
            assert (got - want).abs().max() <= bound
        assert int(mine.get_seq_length()) == 12
    ref = hf.generate(ids, max_new_tokens=6, do_sample=False)
    out = genkit.generate(ours, ids, max_new_tokens=6, do_sample=False,
                          past_key_values=transformers.DynamicCache(config=config))
    assert torch.equal(out, ref)


def test_transformers_generation_config_set_on_a_native_model_is_read(tiny_hf_dir):
    """`model.generation_config = transformers.GenerationConfig(...)` (as transformers users set it)
    is what `generate` reads on a native model, as on transformers' (it was silently left out)."""
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_hf_dir).eval()
    ours = LlamaForCausalLM.from_pretrained(tiny_hf_dir)
    settings = dict(max_new_tokens=9, do_sample=False, repetition_penalty=1.4, no_repeat_ngram_size=2)
    hf.generation_config = transformers.GenerationConfig(**settings)
    ours.generation_config = transformers.GenerationConfig(**settings)
    want = hf.generate(IDS)
    assert want.shape == (2, IDS.shape[1] + 9)
    assert torch.equal(ours.generate(IDS), want) and torch.equal(genkit.generate(ours, IDS), want)
    assert not torch.equal(genkit.load_model(tiny_hf_dir).generate(IDS, max_new_tokens=9, do_sample=False), want)


def test_config_reads_as_transformers_from_pretrained_leaves_it(tiny_hf_dir, tmp_path):
    """`model.config` of a native model answers what transformers' config answers after
    `from_pretrained`: `dtype` / `torch_dtype` the weights' torch dtype (it was config.json's string,
    "float32" even after `dtype=torch.bfloat16`), transformers' defaults of fields config.json leaves
    out (they read as None), `to_json_string()` / `save_pretrained()` (they raised "'NoneType'
    object is not callable"), and the model's `name_or_path`."""
    for kw in ({}, {"dtype": torch.bfloat16}):
        hf = transformers.LlamaForCausalLM.from_pretrained(tiny_hf_dir, **kw)
        ours = LlamaForCausalLM.from_pretrained(tiny_hf_dir, **kw)
        assert ours.config.dtype == hf.config.dtype == ours.dtype and isinstance(ours.config.dtype, torch.dtype)
        assert ours.config.torch_dtype == hf.config.torch_dtype
        for name in ("is_encoder_decoder", "return_dict", "use_return_dict", "output_attentions",
                     "output_hidden_states", "_name_or_path"):
            assert getattr(ours.config, name) == getattr(hf.config, name), name
        assert ours.name_or_path == hf.name_or_path == str(tiny_hf_dir)
    assert json.loads(ours.config.to_json_string())["dtype"] == "bfloat16"
    ours.config.save_pretrained(tmp_path / "config")
    back = transformers.AutoConfig.from_pretrained(tmp_path / "config")
    assert type(back) is type(hf.config) and back.dtype == torch.bfloat16
    assert (back.num_hidden_layers, back.num_key_value_heads) == (hf.config.num_hidden_layers, 2)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("hidden", [False, True])  # the one-call step and the module path
def test_a_padded_2d_mask_shorter_than_the_keys_is_a_config_error(arch, hidden, tiny_pair, gpt2_pair):
    """A left-padded 2-D `attention_mask` without a column for every key (the cache's and the new
    token's) names the parameter and the length it needs; it was torch's "The size of tensor a (6)
    must match the size of tensor b (4)"."""
    _, ours = tiny_pair if arch == "llama" else gpt2_pair
    mask = torch.tensor([[0, 1, 1, 1, 1], [1] * 5])
    cache = ours(IDS, attention_mask=mask).past_key_values
    step = torch.tensor([[3], [4]])
    with pytest.raises(ConfigError, match=r"a 2-D `attention_mask` must have a column for each key: the cache's 5 "
                                          r"positions and the 1 new ones \(6\) here; got 4"):
        ours(step, attention_mask=mask[:, :4], past_key_values=cache, output_hidden_states=hidden)
    assert cache.get_seq_length() == 5  # nothing written
    full = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    assert ours(step, attention_mask=full, past_key_values=cache).logits.shape[:2] == (2, 1)


class _CountingCache(transformers.DynamicCache):
    """A user's (or a recipe's) subclass of transformers' cache, defined outside transformers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.updates += 1
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def test_users_subclasses_of_transformers_classes_are_read_as_transformers_objects(tiny_pair, tiny_hf_dir):
    """Subclasses of transformers' classes defined outside transformers are transformers objects:
    a `DynamicCache` subclass written by the native forward (it was handed genkit's argument order:
    "only integer tensors of a single element can be converted to an index"), a subclass of
    transformers' `LlamaForCausalLM` driven by genkit's beam search (it was not wrapped: "'DynamicCache'
    object has no attribute 'repeat_interleave'") and a `GenerationConfig` subclass (refused as not a
    genkit.GenerationConfig); each gives what transformers gives."""
    hf, ours = tiny_pair
    mine, theirs = _CountingCache(config=hf.config), _CountingCache(config=hf.config)
    for part in (IDS[:, :3], IDS[:, 3:]):
        got, want = ours(part, past_key_values=mine).logits, hf(part, past_key_values=theirs).logits
        assert (got - want).abs().max() <= logits_bound(ours, IDS)
    assert mine.updates == theirs.updates == 4 and mine.get_seq_length() == 5
    greedy = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(ours.generate(IDS, past_key_values=_CountingCache(config=hf.config), **greedy),
                       hf.generate(IDS, past_key_values=_CountingCache(config=hf.config), **greedy))

    class MyLlama(transformers.LlamaForCausalLM):
        pass

    theirs_model = MyLlama.from_pretrained(tiny_hf_dir).eval()
    beams = dict(greedy, num_beams=2)
    assert torch.equal(genkit.generate(theirs_model, IDS, **beams), hf.generate(IDS, **beams))

    class MyConfig(transformers.GenerationConfig):
        pass

    assert torch.equal(genkit.generate(ours, IDS, generation_config=MyConfig(**beams)),
                       hf.generate(IDS, generation_config=transformers.GenerationConfig(**beams)))


def test_native_cache_layers_read_as_transformers_5_cache_layers(tiny_pair):
    """`cache.layers[i].keys` / `.values` / `.is_initialized` / `.get_seq_length()` (transformers 5's
    way to read a cache; `key_cache` is gone there) on the cache a native forward returns: what
    transformers' DynamicCache holds for the same prompt (it was an AttributeError)."""
    hf, ours = tiny_pair
    mine, theirs = ours(IDS).past_key_values, hf(IDS).past_key_values
    assert len(mine.layers) == len(theirs.layers) == hf.config.num_hidden_layers
    for a, b in zip(mine.layers, theirs.layers):
        assert a.is_initialized and b.is_initialized and a.get_seq_length() == b.get_seq_length() == 5
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert x.shape == y.shape and (x - y).abs().max() <= logits_bound(ours, IDS)
    empty = ours.new_cache(8).layers[0]
    assert not empty.is_initialized and empty.keys is None and empty.get_seq_length() == 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_get_decoder_is_transformers_base_model(arch, tiny_pair, gpt2_pair):
    """`model.get_decoder()` on a native model is the decoder without the head, called as
    transformers' base model (`LlamaModel`, `GPT2Model`): its `last_hidden_state` is transformers'
    (to the derived bound), the cache it returns continues the sequence, and the head on it gives
    the forward's logits (native models had no `get_decoder`: an AttributeError)."""
    hf, ours = tiny_pair if arch == "llama" else gpt2_pair
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (transformers' forward counts the pads, genkit's does not)
    decoder = ours.get_decoder()
    out = decoder(input_ids=IDS, attention_mask=mask, position_ids=positions, use_cache=True, output_hidden_states=True)
    want = hf.get_decoder()(input_ids=IDS, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    real = mask.bool()  # (a padded position's state is nobody's)
    atol = hidden_bound(ours.config, IDS.shape[1], ours.config.num_hidden_layers, want.last_hidden_state)
    torch.testing.assert_close(out.last_hidden_state[real], want.last_hidden_state[real], rtol=0, atol=atol)
    assert len(out.hidden_states) == len(want.hidden_states) and torch.equal(out.hidden_states[-1], out.last_hidden_state)
    logits = ours(IDS, attention_mask=mask, position_ids=positions).logits
    head = ours.get_output_embeddings()
    # the forward's head may run on another kernel (packed, gemv: the per-CPU choice) than nn.Linear here:
    # two evaluations of the same product, within 2 gamma_K |h| |W| elementwise (tolerance.matmul_bound)
    bound = matmul_bound(out.last_hidden_state, head.weight)
    assert bool(((head(out.last_hidden_state).double() - logits.double()).abs() <= bound).all())
    step = torch.tensor([[4], [8]])
    more = decoder(input_ids=step, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
                   past_key_values=out.cache, use_cache=True)
    whole = ours(torch.cat([IDS, step], 1), attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1))
    bound = logits_bound(ours, torch.cat([IDS, step], 1))
    torch.testing.assert_close(ours.get_output_embeddings()(more.last_hidden_state)[:, -1], whole.logits[:, -1],
                               rtol=0, atol=bound)
    assert decoder(input_ids=IDS, return_dict=False)[0].shape == out.last_hidden_state.shape


def test_get_decoder_without_the_cache_on_native_models_and_the_view(tiny_pair):
    """`use_cache=False` on the decoder gives the same last hidden state and no cache, on a native
    model and on its transformers view (whose decoder returns transformers' own output class; it
    failed with a KeyError: transformers' outputs drop None fields); the decoder answers `device`
    and `dtype` as a transformers base model does."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    from genkit.models.hf_view import transformers_view

    hf, ours = tiny_pair
    for model in (ours, transformers_view(ours)):
        decoder = model.get_decoder()
        assert decoder.device == ours.device and decoder.dtype == ours.dtype
        cached = decoder(input_ids=IDS, use_cache=True)
        plain = decoder(input_ids=IDS, use_cache=False)
        assert torch.equal(plain.last_hidden_state, cached.last_hidden_state)
        assert plain.cache is None and cached.cache is not None
    assert isinstance(plain, BaseModelOutputWithPast) and not isinstance(cached, CausalLMOutput)
    assert decoder(input_ids=IDS, use_cache=False, return_dict=False)[0].shape == plain.last_hidden_state.shape

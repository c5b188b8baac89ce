"""Models we did not write: small random-weight builds of real architectures, for the real-model tests.

Every builder returns `(model.eval(), args, kwargs)`: a model built from a config with tiny sizes
(nothing is downloaded), and deterministic inputs for one forward of batch 1-2 and a handful of
positions. `REAL_MODELS` maps each name to a `RealModel`: the builder, the dotted path of one
Linear (or Conv1d) weight in the middle of the model, and the op that reads that weight, as the
narration names it (op name and module path), which torchlens must blame when the weight holds a NaN.

`TRAINING` maps some of the same architectures to a `TrainingModel`: a build of it in `.train()`
mode with dropout active (with the head that computes the model's own loss, where it has one), and
the scalar loss of its output, for a training step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Tuple

import torch
from torch import nn

VOCAB = 99


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(batch: int, length: int, vocab: int = VOCAB, seed: int = 1, low: int = 4) -> torch.Tensor:
    """Token ids that avoid the low ids, which the configs use as special tokens (pad, bos, eos)."""
    return torch.randint(low, vocab, (batch, length), generator=_seeded(seed))


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


# -- decoder-only language models ------------------------------------------------------------


def _mistral_config(**extra):
    return _transformers().MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=None, attn_implementation="eager",
        **extra)


def mistral():
    t = _transformers()
    torch.manual_seed(0)
    model = t.MistralForCausalLM(_mistral_config())
    ids = _ids(2, 7)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding on the second row
    return model.eval(), (ids,), {"attention_mask": mask, "use_cache": False}


def mixtral():
    t = _transformers()
    torch.manual_seed(0)
    config = t.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                             num_experts_per_tok=2, max_position_embeddings=64, sliding_window=None,
                             attn_implementation="eager")
    model = t.MixtralForCausalLM(config)
    return model.eval(), (_ids(1, 6, seed=2),), {"use_cache": False}


def qwen2():
    t = _transformers()
    torch.manual_seed(0)
    config = t.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           attn_implementation="sdpa")
    model = t.Qwen2ForCausalLM(config)
    return model.eval(), (_ids(2, 6, seed=3),), {"use_cache": False}


# -- encoders --------------------------------------------------------------------------------


def _distilbert_config(**extra):
    return _transformers().DistilBertConfig(vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
                                            max_position_embeddings=64, attn_implementation="eager", **extra)


def distilbert():
    t = _transformers()
    torch.manual_seed(0)
    model = t.DistilBertModel(_distilbert_config())
    ids = _ids(2, 8, seed=4)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # right padding on the first row
    return model.eval(), (ids,), {"attention_mask": mask}


def clip():
    t = _transformers()
    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=16, projection_dim=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=16, patch_size=8, num_channels=3, projection_dim=16)
    config = t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16,
                          attn_implementation="eager")
    model = t.CLIPModel(config)
    ids = _ids(2, 5, seed=5)
    pixels = torch.randn(2, 3, 16, 16, generator=_seeded(6))
    return model.eval(), (), {"input_ids": ids, "pixel_values": pixels}


def wav2vec2():
    t = _transformers()
    torch.manual_seed(0)
    config = t.Wav2Vec2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                              num_feat_extract_layers=2, num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
                              do_stable_layer_norm=False, feat_extract_norm="group", apply_spec_augment=False,
                              attn_implementation="eager")
    model = t.Wav2Vec2Model(config)
    audio = torch.randn(1, 80, generator=_seeded(7))  # 80 samples -> 7 frames
    return model.eval(), (audio,), {}


# -- encoder-decoders ------------------------------------------------------------------------


def _bart_config(**extra):
    return _transformers().BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, max_position_embeddings=64, attn_implementation="eager",
                                      **extra)


def bart():
    t = _transformers()
    torch.manual_seed(0)
    model = t.BartModel(_bart_config())
    return model.eval(), (_ids(2, 7, seed=8),), {"decoder_input_ids": _ids(2, 5, seed=9), "use_cache": False}


def _t5_config(**extra):
    return _transformers().T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                    num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                                    relative_attention_max_distance=16, decoder_start_token_id=0,
                                    attn_implementation="eager", **extra)


def t5():
    t = _transformers()
    torch.manual_seed(0)
    model = t.T5Model(_t5_config())
    return model.eval(), (_ids(1, 6, seed=10),), {"decoder_input_ids": _ids(1, 5, seed=11), "use_cache": False}


def whisper():
    t = _transformers()
    torch.manual_seed(0)
    config = t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
                             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                             decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16,
                             pad_token_id=1, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2,
                             attn_implementation="eager")
    model = t.WhisperModel(config)
    features = torch.randn(1, 8, 16, generator=_seeded(12))  # 16 frames -> 8 positions after the stride-2 conv
    return model.eval(), (features,), {"decoder_input_ids": _ids(1, 5, seed=13), "use_cache": False}


# -- torch.nn ---------------------------------------------------------------------------------


def nn_transformer_encoder(dropout: float = 0.0):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=dropout, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
    src = torch.randn(2, 6, 32, generator=_seeded(14))
    # an additive float mask: 0 where a position is kept, a large finite negative where it is padding
    # (a bool mask would be turned into -inf by the encoder, a non-finite value of its own)
    padding = torch.zeros(2, 6)
    padding[0, 4:] = -1e9  # the first sequence is two positions shorter
    padding[1, 5:] = -1e9
    return model.eval(), (src,), {"src_key_padding_mask": padding}


def nn_transformer():
    torch.manual_seed(0)
    model = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
                           dropout=0.0, batch_first=True)
    src = torch.randn(2, 6, 32, generator=_seeded(15))
    tgt = torch.randn(2, 5, 32, generator=_seeded(16))
    tgt_mask = torch.triu(torch.full((5, 5), -1e9), diagonal=1)  # causal, finite (not -inf)
    # tgt_is_causal given, so the decoder does not build an -inf causal mask to compare tgt_mask with
    return model.eval(), (src, tgt), {"tgt_mask": tgt_mask, "tgt_is_causal": False}


# -- the table -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RealModel:
    build: Callable[[], Tuple[nn.Module, tuple, dict]]
    weight: str  # dotted path of a Linear/Conv1d weight in the middle of the model
    op: str  # the op that reads it, as the narration names it
    module: str  # the module path that op is narrated in
    also: Tuple[Tuple[str, str], ...] = ()  # other (op, module) that may legitimately read it

    @property
    def blame(self) -> Tuple[Tuple[str, str], ...]:
        """Every (op, module) a NaN in `weight` may be blamed on: `(op, module)` first."""
        return ((self.op, self.module),) + self.also

    def poisoned(self):
        """A fresh build with a NaN in `weight`."""
        model, args, kwargs = self.build()
        with torch.no_grad():
            model.get_parameter(self.weight)[0, 0] = float("nan")
        return model, args, kwargs


def _at(build, module: str, op: str = "linear", weight: str = "weight", also=()) -> RealModel:
    return RealModel(build, f"{module}.{weight}", op, module, tuple(also))


REAL_MODELS: Dict[str, RealModel] = {
    "mistral": _at(mistral, "model.layers.1.self_attn.k_proj"),
    # the router: a Linear-shaped weight read by F.linear (the experts' weights are 3-d, read by _grouped_mm)
    "mixtral": _at(mixtral, "model.layers.1.mlp.gate"),
    "qwen2": _at(qwen2, "model.layers.1.self_attn.v_proj"),
    "whisper": _at(whisper, "encoder.layers.1.fc1"),
    "clip": _at(clip, "vision_model.encoder.layers.1.mlp.fc1"),
    "distilbert": _at(distilbert, "transformer.layer.1.attention.q_lin"),
    "wav2vec2": _at(wav2vec2, "encoder.layers.0.feed_forward.intermediate_dense"),
    "bart": _at(bart, "decoder.layers.0.encoder_attn.k_proj"),
    "t5": _at(t5, "encoder.block.1.layer.1.DenseReluDense.wi"),
    # eagerly (no_grad, eval, a padding mask) the encoder takes its fast path, where each layer is one
    # fused op that reads linear1's weight; without the fast path it is read by linear1's own linear
    "nn_transformer_encoder": _at(nn_transformer_encoder, "layers.1.linear1",
                                  also=[("_transformer_encoder_layer_fwd", "layers.1")]),
    "nn_transformer": _at(nn_transformer, "decoder.layers.0.linear2"),
}


# -- training steps ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainingModel:
    """A build in `.train()` mode with dropout active, and the scalar loss of one of its outputs."""

    build: Callable[[], Tuple[nn.Module, tuple, dict]]
    loss: Callable[[object], torch.Tensor]

    def built(self):
        model, args, kwargs = self.build()
        return model.train(), args, kwargs


def _own_loss(output) -> torch.Tensor:
    return output.loss


def mistral_lm_training():
    """Mistral has no dropout but its attention's: the default 0.0 is raised so that one draws."""
    t = _transformers()
    torch.manual_seed(0)
    model = t.MistralForCausalLM(_mistral_config(attention_dropout=0.1))
    ids = _ids(2, 7)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    labels = ids.masked_fill(mask == 0, -100)  # no loss on the padding
    return model, (ids,), {"attention_mask": mask, "labels": labels, "use_cache": False}


def bart_seq2seq_training():
    t = _transformers()
    torch.manual_seed(0)
    model = t.BartForConditionalGeneration(_bart_config(dropout=0.1, attention_dropout=0.1, activation_dropout=0.1))
    return model, (_ids(2, 7, seed=8),), {"labels": _ids(2, 5, seed=9), "use_cache": False}


def distilbert_mlm_training():
    t = _transformers()
    torch.manual_seed(0)
    model = t.DistilBertForMaskedLM(_distilbert_config(dropout=0.1, attention_dropout=0.1))
    ids = _ids(2, 8, seed=4)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    return model, (ids,), {"attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def t5_seq2seq_training():
    t = _transformers()
    torch.manual_seed(0)
    model = t.T5ForConditionalGeneration(_t5_config(dropout_rate=0.1))
    return model, (_ids(1, 6, seed=10),), {"labels": _ids(1, 5, seed=11), "use_cache": False}


# The encoder's output is layer-normed: its sum, or its mean square, is all but constant, and its
# gradients all but zero. A fixed random projection of it is a loss whose gradients are not.
_ENCODER_TARGET = torch.randn(2, 6, 32, generator=_seeded(17))


TRAINING: Dict[str, TrainingModel] = {
    "mistral": TrainingModel(mistral_lm_training, _own_loss),
    "bart": TrainingModel(bart_seq2seq_training, _own_loss),
    "distilbert": TrainingModel(distilbert_mlm_training, _own_loss),
    "t5": TrainingModel(t5_seq2seq_training, _own_loss),
    # in training torch leaves its fast path (and nested tensors): the layers run op by op
    "nn_transformer_encoder": TrainingModel(lambda: nn_transformer_encoder(dropout=0.1),
                                            lambda output: (output * _ENCODER_TARGET).sum()),
}


def llama_with_a_compiled_mlp():
    """A 2-layer transformers Llama whose second layer's MLP is `torch.compile`d (backend eager):
    a compiled submodule inside a model narrated eagerly. The MLP, not the whole layer: attention's
    rotary embedding dispatches through the `kernels` package's global, which becomes shared by
    every thread once dynamo traced it (its docs say so), and threads toggling it made plain
    forwards recompile too, now and then."""
    t = _transformers()
    torch.manual_seed(0)
    config = t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    model = t.LlamaModel(config).eval()
    model.layers[1].mlp = torch.compile(model.layers[1].mlp, backend="eager")
    return model

"""Sweep: Hugging Face encoder, encoder-decoder and audio models no test names yet (tiny configs, no download).

Run: ``PYTHONPATH=tests python -m helpers.hf_encoders [names...] [--trace]``; one line per model (see helpers/sweep.py).
"""

from __future__ import annotations

from typing import Any

import torch

from helpers import sweep as harness
import transformers

B, T, V = 2, 8, 64
SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             max_position_embeddings=40)


def ids(low: int = 0, batch: int = B, length: int = T) -> torch.Tensor:
    return torch.randint(low, V, (batch, length), generator=torch.Generator().manual_seed(batch))


def padded(batch: int = B, length: int = T) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length - 2:] = 0
    return mask


def bert_cfg(**kw: Any) -> transformers.BertConfig:
    return transformers.BertConfig(vocab_size=V, **SMALL, **kw)


def roberta_cfg(**kw: Any) -> transformers.RobertaConfig:
    return transformers.RobertaConfig(vocab_size=V, **SMALL, pad_token_id=1, **kw)


def bart_like(config_cls: type, **kw: Any) -> Any:
    return config_cls(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=40,
                      pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, use_cache=False,
                      **kw)


def seq2seq(model: Any, mask: bool = False) -> harness.Built:
    kw: dict[str, Any] = {"input_ids": ids(3), "decoder_input_ids": ids(3, batch=B + 1)[:B]}
    if mask:
        kw["attention_mask"] = padded()
    return model, kw


def audio_values() -> torch.Tensor:
    return torch.randn(B, 400, generator=torch.Generator().manual_seed(0))


def wav2vec2_cfg(config_cls: type, **kw: Any) -> Any:
    return config_cls(**{**dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                                num_conv_pos_embedding_groups=2, vocab_size=V, do_stable_layer_norm=False,
                                feat_extract_norm="group", mask_time_prob=0.0, mask_feature_prob=0.0), **kw})


REGISTRY: dict[str, Any] = {
    "RobertaModel": lambda: (transformers.RobertaModel(roberta_cfg()), {"input_ids": ids(2)}),
    "RobertaModel+pad": lambda: (transformers.RobertaModel(roberta_cfg()),
                                 {"input_ids": ids(2), "attention_mask": padded()}),
    "BertModel+pad+types": lambda: (transformers.BertModel(bert_cfg()),
                                    {"input_ids": ids(), "attention_mask": padded(),
                                     "token_type_ids": (torch.arange(T) >= T // 2).long().expand(B, T)}),
    "DistilBertModel": lambda: (transformers.DistilBertModel(transformers.DistilBertConfig(
        vocab_size=V, dim=16, hidden_dim=32, n_layers=1, n_heads=2, max_position_embeddings=40)),
        {"input_ids": ids(), "attention_mask": padded()}),
    "AlbertModel": lambda: (transformers.AlbertModel(transformers.AlbertConfig(
        vocab_size=V, embedding_size=8, **SMALL)), {"input_ids": ids()}),
    "ElectraModel": lambda: (transformers.ElectraModel(transformers.ElectraConfig(
        vocab_size=V, embedding_size=8, **SMALL)), {"input_ids": ids()}),
    "DebertaModel": lambda: (transformers.DebertaModel(transformers.DebertaConfig(
        vocab_size=V, **SMALL, relative_attention=True, max_relative_positions=16,
        pos_att_type=["c2p", "p2c"])), {"input_ids": ids()}),
    "DebertaV2Model": lambda: (transformers.DebertaV2Model(transformers.DebertaV2Config(
        vocab_size=V, **SMALL, relative_attention=True, position_buckets=8, max_relative_positions=16,
        pos_att_type=["c2p", "p2c"])), {"input_ids": ids()}),
    "XLMRobertaModel": lambda: (transformers.XLMRobertaModel(transformers.XLMRobertaConfig(
        vocab_size=V, **SMALL, pad_token_id=1)), {"input_ids": ids(2)}),
    "MPNetModel": lambda: (transformers.MPNetModel(transformers.MPNetConfig(
        vocab_size=V, **SMALL, pad_token_id=1)), {"input_ids": ids(2)}),
    "BertForSequenceClassification+labels": lambda: (
        transformers.BertForSequenceClassification(bert_cfg(num_labels=3)),
        {"input_ids": ids(), "labels": torch.tensor([0, 2])}),
    "BertForTokenClassification": lambda: (
        transformers.BertForTokenClassification(bert_cfg(num_labels=3)), {"input_ids": ids()}),
    "BertForQuestionAnswering": lambda: (
        transformers.BertForQuestionAnswering(bert_cfg()), {"input_ids": ids()}),
    "BertForSequenceClassification+regression": lambda: (
        transformers.BertForSequenceClassification(bert_cfg(num_labels=1)),
        {"input_ids": ids(), "labels": torch.tensor([0.5, -1.0])}),
    "BertForMultipleChoice": lambda: (transformers.BertForMultipleChoice(bert_cfg()),
                                      {"input_ids": ids(batch=B * 3).view(B, 3, T)}),
    "BertForPreTraining": lambda: (transformers.BertForPreTraining(bert_cfg()), {"input_ids": ids()}),
    "T5EncoderModel+pad": lambda: (transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, use_cache=False)),
        {"input_ids": ids(), "attention_mask": padded()}),
    "AlbertForMaskedLM": lambda: (transformers.AlbertForMaskedLM(transformers.AlbertConfig(
        vocab_size=V, embedding_size=8, **SMALL)), {"input_ids": ids()}),
    "RobertaForMaskedLM": lambda: (transformers.RobertaForMaskedLM(roberta_cfg()), {"input_ids": ids(2)}),
    "BartForConditionalGeneration": lambda: seq2seq(
        transformers.BartForConditionalGeneration(bart_like(transformers.BartConfig))),
    "BartForConditionalGeneration+pad": lambda: seq2seq(
        transformers.BartForConditionalGeneration(bart_like(transformers.BartConfig)), mask=True),
    "MBartForConditionalGeneration": lambda: seq2seq(
        transformers.MBartForConditionalGeneration(bart_like(transformers.MBartConfig))),
    "PegasusForConditionalGeneration": lambda: seq2seq(
        transformers.PegasusForConditionalGeneration(bart_like(transformers.PegasusConfig))),
    "MarianMTModel": lambda: seq2seq(transformers.MarianMTModel(bart_like(
        transformers.MarianConfig, decoder_vocab_size=V))),
    "MT5ForConditionalGeneration": lambda: (transformers.MT5ForConditionalGeneration(transformers.MT5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0,
        use_cache=False)), {"input_ids": ids(), "decoder_input_ids": ids(batch=B + 1)[:B]}),
    "T5ForConditionalGeneration+labels": lambda: (transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0,
        pad_token_id=0, use_cache=False)), {"input_ids": ids(), "labels": ids(1, batch=B + 1)[:B]}),
    "WhisperForConditionalGeneration": lambda: (transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(vocab_size=V, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                   decoder_ffn_dim=32, max_source_positions=8, max_target_positions=16,
                                   pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                                   use_cache=False)),
        {"input_features": torch.randn(B, 8, 16, generator=torch.Generator().manual_seed(0)),
         "decoder_input_ids": ids(3, batch=B + 1)[:B]}),
    "Wav2Vec2Model": lambda: (transformers.Wav2Vec2Model(wav2vec2_cfg(transformers.Wav2Vec2Config)),
                              {"input_values": audio_values()}),
    "HubertModel": lambda: (transformers.HubertModel(wav2vec2_cfg(transformers.HubertConfig)),
                            {"input_values": audio_values()}),
    "Wav2Vec2Model+nolayerdrop": lambda: (
        transformers.Wav2Vec2Model(wav2vec2_cfg(transformers.Wav2Vec2Config, layerdrop=0.0)),
        {"input_values": audio_values()}),
    "Wav2Vec2Model+nolayerdrop+pad": lambda: (
        transformers.Wav2Vec2Model(wav2vec2_cfg(transformers.Wav2Vec2Config, layerdrop=0.0,
                                                feat_extract_norm="layer")),
        {"input_values": audio_values(), "attention_mask": padded(length=400)}),
    "Wav2Vec2ForCTC+labels": lambda: (
        transformers.Wav2Vec2ForCTC(wav2vec2_cfg(transformers.Wav2Vec2Config, layerdrop=0.0, pad_token_id=0)),
        {"input_values": audio_values(), "labels": ids(1, length=4)}),
    "HubertModel+nolayerdrop": lambda: (
        transformers.HubertModel(wav2vec2_cfg(transformers.HubertConfig, layerdrop=0.0)),
        {"input_values": audio_values()}),
    "WavLMModel": lambda: (transformers.WavLMModel(wav2vec2_cfg(
        transformers.WavLMConfig, layerdrop=0.0, num_buckets=8, max_bucket_distance=16)),
        {"input_values": audio_values()}),
    "Data2VecAudioModel": lambda: (transformers.Data2VecAudioModel(wav2vec2_cfg(
        transformers.Data2VecAudioConfig, layerdrop=0.0, conv_pos_kernel_size=3, num_conv_pos_embeddings=4)),
        {"input_values": audio_values()}),
    "FunnelModel": lambda: (transformers.FunnelModel(transformers.FunnelConfig(
        vocab_size=V, d_model=16, n_head=2, d_head=8, d_inner=32, block_sizes=[1, 1], num_decoder_layers=1)),
        {"input_ids": ids(), "attention_mask": padded()}),
    "ConvBertModel": lambda: (transformers.ConvBertModel(transformers.ConvBertConfig(
        vocab_size=V, embedding_size=16, **SMALL)), {"input_ids": ids()}),
    "SqueezeBertModel": lambda: (transformers.SqueezeBertModel(transformers.SqueezeBertConfig(
        vocab_size=V, embedding_size=16, **SMALL, q_groups=1, k_groups=1, v_groups=1, post_attention_groups=1,
        intermediate_groups=1, output_groups=1)), {"input_ids": ids()}),
    "LEDForConditionalGeneration": lambda: seq2seq(transformers.LEDForConditionalGeneration(transformers.LEDConfig(
        vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_encoder_position_embeddings=40,
        max_decoder_position_embeddings=40, attention_window=[4], pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, use_cache=False))),
    "BlenderbotSmallForConditionalGeneration": lambda: seq2seq(
        transformers.BlenderbotSmallForConditionalGeneration(bart_like(transformers.BlenderbotSmallConfig))),
    "M2M100ForConditionalGeneration": lambda: seq2seq(
        transformers.M2M100ForConditionalGeneration(bart_like(transformers.M2M100Config))),
    "M2M100ForConditionalGeneration+nolayerdrop": lambda: seq2seq(transformers.M2M100ForConditionalGeneration(
        bart_like(transformers.M2M100Config, encoder_layerdrop=0.0, decoder_layerdrop=0.0))),
    "LongformerModel+pad": lambda: (transformers.LongformerModel(transformers.LongformerConfig(
        vocab_size=V, **SMALL, attention_window=4, pad_token_id=1)),
        {"input_ids": ids(2), "attention_mask": padded()}),
    "RoFormerModel": lambda: (transformers.RoFormerModel(transformers.RoFormerConfig(
        vocab_size=V, embedding_size=16, **SMALL)), {"input_ids": ids()}),
    "RemBertModel": lambda: (transformers.RemBertModel(transformers.RemBertConfig(
        vocab_size=V, input_embedding_size=8, output_embedding_size=8, **SMALL)), {"input_ids": ids()}),
    "MegatronBertModel": lambda: (transformers.MegatronBertModel(transformers.MegatronBertConfig(
        vocab_size=V, **SMALL)), {"input_ids": ids(), "attention_mask": padded()}),
    "ErnieModel": lambda: (transformers.ErnieModel(transformers.ErnieConfig(vocab_size=V, **SMALL)),
                           {"input_ids": ids()}),
    "XLMModel": lambda: (transformers.XLMModel(transformers.XLMConfig(
        vocab_size=V, emb_dim=16, n_layers=1, n_heads=2, max_position_embeddings=40)), {"input_ids": ids()}),
    "NystromformerModel": lambda: (transformers.NystromformerModel(transformers.NystromformerConfig(
        vocab_size=V, **SMALL, num_landmarks=4, segment_means_seq_len=T)), {"input_ids": ids()}),
    "LayoutLMModel": lambda: (transformers.LayoutLMModel(transformers.LayoutLMConfig(vocab_size=V, **SMALL)),
                              {"input_ids": ids(), "bbox": torch.randint(0, 100, (B, T, 4)).sort(-1).values}),
    "Speech2TextForConditionalGeneration": lambda: (transformers.Speech2TextForConditionalGeneration(
        transformers.Speech2TextConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1,
                                       encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                       decoder_ffn_dim=32, max_source_positions=40, max_target_positions=40,
                                       num_conv_layers=1, conv_kernel_sizes=[5], conv_channels=8,
                                       input_feat_per_channel=8, input_channels=1, pad_token_id=1,
                                       decoder_start_token_id=2, use_cache=False, encoder_layerdrop=0.0,
                                       decoder_layerdrop=0.0)),
        {"input_features": torch.randn(B, 16, 8), "decoder_input_ids": ids(3, batch=B + 1)[:B]}),
    "SEWModel": lambda: (transformers.SEWModel(wav2vec2_cfg(transformers.SEWConfig, layerdrop=0.0, squeeze_factor=2,
                                                            conv_bias=True)),
                         {"input_values": audio_values()}),
    "UniSpeechModel": lambda: (transformers.UniSpeechModel(wav2vec2_cfg(transformers.UniSpeechConfig, layerdrop=0.0)),
                               {"input_values": audio_values()}),
    "Wav2Vec2ConformerModel": lambda: (transformers.Wav2Vec2ConformerModel(wav2vec2_cfg(
        transformers.Wav2Vec2ConformerConfig, layerdrop=0.0, conv_depthwise_kernel_size=3,
        position_embeddings_type="relative")), {"input_values": audio_values()}),
    "ASTModel": lambda: (transformers.ASTModel(transformers.ASTConfig(
        **{k: v for k, v in SMALL.items() if k != "max_position_embeddings"}, patch_size=8, frequency_stride=8,
        time_stride=8, max_length=16, num_mel_bins=16)), {"input_values": torch.randn(B, 16, 16)}),
}

# A scalar loss (labels=) is one per micro-batch: the pipeline refuses to gather it (BoundaryError saying to
# compute the loss outside), so these check convert, eval, batch + 1 and train only.
for _name in ("BertForSequenceClassification+labels", "BertForSequenceClassification+regression",
              "T5ForConditionalGeneration+labels"):
    REGISTRY[_name].pipeline = False

if __name__ == "__main__":
    raise SystemExit(harness.main(REGISTRY))

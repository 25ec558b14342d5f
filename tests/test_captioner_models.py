"""Captioning with real vision-language models through the studio's Data tab (issue 44, item 4), nothing downloaded:
a tiny randomly initialised transformers-native Florence-2 (`Florence2ForConditionalGeneration`, its processor built
in-process) captions two uploaded images with its task prompt '<CAPTION>' and the processor's post-processing; a tiny
model whose class lives in its own folder (`auto_map` -> a Python file beside `config.json`) is refused without the
page's "Allow the model's own code (trust_remote_code)" box and captions with it, the box's value sent with the
model's name; the original Florence-2 repositories' refusal names the native one. Each model is built and saved in a second or two on a CPU."""
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gradio", reason='the studio needs pip install "course_lib[studio]"')
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from PIL import Image

from course_lib.flux import get_captioner, make_tokenizer
from course_lib.studio import Studio, tiny_bases
from course_lib.studio.tab_data import _data_events, _data_handlers, _data_tab

WORDS = ["<s>", "<pad>", "</s>", "<unk>", "<image>", "what", "does", "the", "image", "describe", "?",
         "a", "bold", "thin", "seven", "nine", "digit", "in", "corner"]


def png(seed: int, size=(24, 20)) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, size[::-1], dtype=np.uint8), "L").save(buf, "PNG")
    return buf.getvalue()


def studio_with_two_images(tmp_path: Path):
    "A studio over the tiny bases with two uploaded images, and the Data tab's handlers over it."
    import gradio as gr
    st = Studio(tmp_path/"studio", tiny_bases())
    assert len(st.add_images([("a.png", png(0)), ("b.png", png(1, (40, 40)))])["added"]) == 2
    return st, _data_handlers(st, gr)


def tiny_florence2(d: Path) -> None:
    """A randomly initialised Florence-2 as transformers itself defines it (DaViT vision tower, BART language model),
    a few thousand parameters, saved with its processor (CLIP image processor, word-level tokenizer with the image
    token, the post-processor's pure-text parsing as the Hub checkpoints configure it)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import (BartConfig, CLIPImageProcessor, Florence2Config,
                              Florence2ForConditionalGeneration, Florence2Processor, PreTrainedTokenizerFast)
    vocab = {w: i for i, w in enumerate(WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.normalizer, tk.pre_tokenizer = normalizers.Lowercase(), pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", extra_special_tokens={"image_token": "<image>"})
    vision = dict(depths=[1, 1, 1, 1], embed_dim=[8, 16, 16, 16], num_heads=[1, 1, 1, 1],
                  num_groups=[1, 1, 1, 1], window_size=2, projection_dim=16, max_position_embeddings=8,
                  max_temporal_embeddings=4)
    text = BartConfig(vocab_size=len(WORDS), d_model=16, encoder_layers=1, decoder_layers=1,
                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                      max_position_embeddings=64, bos_token_id=0, pad_token_id=1, eos_token_id=2,
                      decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None)
    torch.manual_seed(0)
    model = Florence2ForConditionalGeneration(
        Florence2Config(vision_config=vision, text_config=text.to_dict(), image_token_id=vocab["<image>"]))
    image_proc = CLIPImageProcessor(size={"height": 64, "width": 64}, do_center_crop=False)
    image_proc.image_seq_length = (64 // 32) ** 2 + 1        # DaViT's strides 4*2*2*2: 2x2 patches, + 1 pooled
    # untrained, it may end every caption at once: a few words at least, none of them special tokens
    model.generation_config.min_new_tokens = 3
    model.generation_config.suppress_tokens = [vocab[w] for w in ("<s>", "<pad>", "<unk>", "<image>")]
    model.save_pretrained(d)
    Florence2Processor(image_processor=image_proc, tokenizer=tok,
                       post_processor_config={"pure_text": {}}).save_pretrained(d)


def test_a_native_florence2_captions_through_the_data_tab_with_its_task_prompt(tmp_path, monkeypatch):
    from transformers import Florence2ForConditionalGeneration, Florence2Processor
    d = tmp_path/"florence"
    tiny_florence2(d)
    assert json.loads((d/"config.json").read_text())["model_type"] == "florence2"
    prompts, parsed, generate = [], [], Florence2ForConditionalGeneration.generate
    post = Florence2Processor.post_process_generation

    def spy_generate(self, *a, **kw):
        prompts.append(kw["input_ids"])
        return generate(self, *a, **kw)

    def spy_post(self, *a, **kw):
        parsed.append(kw.get("task"))
        return post(self, *a, **kw)
    monkeypatch.setattr(Florence2ForConditionalGeneration, "generate", spy_generate)
    monkeypatch.setattr(Florence2Processor, "post_process_generation", spy_post)
    st, h = studio_with_two_images(tmp_path)
    said, rows = h["caption"](str(d), "sks", False)           # the page's inputs: name, trigger, replace
    assert said.startswith("captioned 2 image(s)"), said
    caps = st.captions()
    assert sorted(caps) == ["a.png", "b.png"] and [r[3] for r in rows] == [caps["a.png"], caps["b.png"]]
    for c in caps.values():
        assert isinstance(c, str) and c.startswith("sks")
        assert len(c.split()) >= 1 + 3 and all(w in WORDS for w in c.split()[1:]), c   # the model's own words
    # the task prompt reached the model: '<CAPTION>' becomes "What does the image describe?" in the processor
    assert len(prompts) == 1 and prompts[0].shape[0] == 2
    tok = get_captioner(str(d)).processor.tokenizer
    for ids in prompts[0]:
        assert "what does the image describe ?" in tok.decode(ids, skip_special_tokens=True)
    assert parsed == ["<CAPTION>", "<CAPTION>"]                   # the answer parsed as Florence-2's task answer


TINY_REMOTE = '''"""A captioner whose classes live in its own folder: a ViT encoder and a GPT-2 decoder under a model type
transformers does not know, so loading it runs this file."""
from transformers import VisionEncoderDecoderConfig, VisionEncoderDecoderModel


class TinyRemoteConfig(VisionEncoderDecoderConfig):
    model_type = "course-tiny-remote"


class TinyRemoteCaptioner(VisionEncoderDecoderModel):
    config_class = TinyRemoteConfig
'''


def tiny_remote_model(d: Path) -> list[str]:
    """A randomly initialised ViT-GPT-2 captioner (a few thousand parameters) whose `config.json` names its own code
    (`auto_map`), with its tokenizer and image processor. Returns the tokenizer's vocabulary."""
    from transformers import (GPT2Config, ViTConfig, ViTImageProcessor, VisionEncoderDecoderConfig,
                              VisionEncoderDecoderModel)
    tok = make_tokenizer(16)
    enc = ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                    image_size=16, patch_size=8)
    dec = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=len(tok), n_positions=32,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id = tok.bos_token_id, tok.pad_token_id
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(0)
    VisionEncoderDecoderModel(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(d)
    (d/"tiny_remote.py").write_text(TINY_REMOTE, encoding="utf-8")
    c = json.loads((d/"config.json").read_text())
    c.update(model_type="course-tiny-remote", architectures=["TinyRemoteCaptioner"],
             auto_map={"AutoConfig": "tiny_remote.TinyRemoteConfig",
                       "AutoModelForImageTextToText": "tiny_remote.TinyRemoteCaptioner"})
    (d/"config.json").write_text(json.dumps(c, indent=1))
    return list(tok.get_vocab())


def test_a_model_with_its_own_code_captions_only_when_the_page_allows_it(tmp_path):
    d = tmp_path/"remote"
    vocab = tiny_remote_model(d)
    st, h = studio_with_two_images(tmp_path)
    said, _ = h["caption"](str(d), "sks", False, False)       # the box left unticked: refused, said on the page
    assert said.startswith("**error**") and "trust_remote_code" in said and str(d) in said, said
    assert set(st.captions().values()) == {""}                # nothing written
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        get_captioner(str(d))
    said, rows = h["caption"](str(d), "sks", False, True)     # ticked: the folder's own classes caption
    assert said.startswith("captioned 2 image(s)"), said
    for c in st.captions().values():
        assert c.startswith("sks") and all(w in vocab for w in c.split()[1:]), c
    model = get_captioner(str(d), trust_remote_code=True).model
    assert type(model).__name__ == "TinyRemoteCaptioner" and "tiny_remote" in type(model).__module__


def test_the_original_florence2_repositories_are_refused_naming_the_native_one(tmp_path):
    "Microsoft's Florence-2 repositories run their own code: without the opt-in the error names the native copy."
    d = tmp_path/"microsoft"/"Florence-2-large-ft"
    d.mkdir(parents=True)
    (d/"config.json").write_text(json.dumps({
        "model_type": "florence2", "architectures": ["Florence2ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_florence2.Florence2Config",
                     "AutoModelForCausalLM": "modeling_florence2.Florence2ForConditionalGeneration"}}))
    with pytest.raises(ValueError) as e:
        get_captioner(str(d))
    said = str(e.value)
    assert "trust_remote_code=True" in said and "'florence-community/Florence-2-large-ft'" in said, said
    assert "\n" not in said                                    # the page shows an error's first line


def test_the_data_tab_offers_native_florence2_and_sends_the_opt_in_with_the_name(tmp_path):
    import gradio as gr
    st = Studio(tmp_path/"studio", tiny_bases())
    with gr.Blocks() as demo:
        ui = _data_tab(st, gr)
        _data_events(st, gr, ui)
    offered = [v for _, v in ui["captioner"].choices]
    assert "florence-community/Florence-2-base" in offered and "microsoft/Florence-2-base" not in offered
    box = ui["trust_code"]
    assert box.label == "Allow the model's own code (trust_remote_code)" and box.value is False
    assert "runs on this computer" in box.info and "florence-community/Florence-2-base" in box.info
    click = next(d for d in demo.config["dependencies"] if d.get("api_name") == "caption")
    assert click["inputs"] == [ui[k]._id for k in ("captioner", "trigger", "replace", "trust_code")]

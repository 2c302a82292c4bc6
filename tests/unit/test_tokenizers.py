"""The tokenizer interface: CharTokenizer (the toy tasks', re-exported by rollbook.tasks) saves a real
Hugging Face tokenizer that round-trips its ids; HFTokenizer applies chat templates, encodes plain
prompts as they are, and stops on eos and stop strings."""

from __future__ import annotations

import pytest

from rollbook import tasks
from rollbook.tokenizers import CharTokenizer, HFTokenizer, StopStrings, Tokenizer, cut_at_stop_strings, load_tokenizer
from tests.hf_fixtures import ASSISTANT, BOS, EOS, USER, save_bpe_tokenizer


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return save_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


def test_char_tokenizer_is_still_importable_from_tasks_and_implements_the_protocol():
    assert tasks.CharTokenizer is CharTokenizer and isinstance(tasks.TOKENIZER, CharTokenizer)
    assert isinstance(tasks.TOKENIZER, Tokenizer)
    assert tasks.TOKENIZER.encode_prompt("12+34=") == tasks.TOKENIZER.encode("12+34=", add_bos=True)
    assert tasks.TOKENIZER.stop_token_ids == [tasks.TOKENIZER.eos_token_id]


def test_char_tokenizer_save_pretrained_round_trips_through_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = tasks.TOKENIZER
    tok.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert len(hf) == tok.vocab_size
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    for text in ["12+34=", "rev:abcd=", "a b, c.d?! 0-9*x;y:", " spaced  out "]:
        assert hf.encode(text) == tok.encode(text, add_bos=True), text  # the <bos> the toy model was trained with
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
        assert hf.decode(tok.encode(text, add_eos=True), skip_special_tokens=True) == text
    assert hf.encode("<eos>", add_special_tokens=False) == [tok.eos_token_id]


def test_hf_tokenizer_chat_rows_plain_prompts_and_stops(bpe_dir):
    tok = load_tokenizer(bpe_dir, default=tasks.TOKENIZER, stop_strings=["###"])
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    hf = tok.hf
    assert tok.vocab_size == len(hf) and tok.eos_token_id == hf.convert_tokens_to_ids(EOS)
    chat = tok.encode_prompt(messages=[{"role": "user", "content": "What is 2 times 3?"}])
    text = hf.decode(chat)
    assert text.startswith(BOS + USER + "What is 2 times 3?" + EOS) and text.endswith(ASSISTANT)
    plain = tok.encode_prompt(prompt="What is 2 times 3?")
    assert hf.decode(plain) == "What is 2 times 3?"  # used as it is: no template
    answer = tok.encode("The answer is 6") + [tok.eos_token_id] + tok.encode("junk")
    assert tok.completion_text(answer) == "The answer is 6"
    assert tok.completion_text(tok.encode("6 ### more")) == "6 "
    assert tok.stop_token_ids == [tok.eos_token_id]
    with pytest.raises(ValueError, match="prompt or messages"):
        tok.encode_prompt()


def test_stop_strings_predicate_sees_the_decoded_tail(bpe_dir):
    tok = load_tokenizer(bpe_dir, default=tasks.TOKENIZER)
    stop = StopStrings(tok, ["</answer>"])
    ids = tok.encode("think 12 </answer>")
    first = next(i for i in range(1, len(ids) + 1) if stop(ids[:i]))
    assert "</answer>" in tok.decode(ids[:first]) and "</answer>" not in tok.decode(ids[: first - 1])
    assert not StopStrings(tok, [])(ids)
    assert cut_at_stop_strings("a</answer>b", ["</answer>", "b"]) == "a"


def test_missing_directory_and_no_template_are_precise_errors(tmp_path, bpe_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope", default=tasks.TOKENIZER)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(bpe_dir), local_files_only=True)
    hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        HFTokenizer(bpe_dir, tokenizer=hf).encode_prompt(messages=[{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        tasks.TOKENIZER.encode_prompt(messages=[{"role": "user", "content": "x"}])


def test_load_tokenizer_default_is_the_toy_tokenizer():
    assert load_tokenizer(None, default=tasks.TOKENIZER) is tasks.TOKENIZER
    with_stop = load_tokenizer(None, default=tasks.TOKENIZER, stop_strings=[";"])
    assert with_stop.completion_text(tasks.TOKENIZER.encode("12;3")) == "12"


def test_the_fixture_model_directory_loads_with_auto_classes_and_generates(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.hf_fixtures import save_tiny_model_dir

    path = save_tiny_model_dir(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 times 3?"}], add_generation_prompt=True, tokenize=False)
    inputs = torch.tensor([tok.encode(ids, add_special_tokens=False)])
    out = model.generate(inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs.shape[1]

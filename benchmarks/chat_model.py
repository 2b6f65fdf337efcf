"""Small chat models as Hugging Face directories, for the OpenAI API tests and benchmarks/serve_llm.py:
a random-weight Llama and a byte-level BPE tokenizer trained here (on a few sentences, so that some
characters' UTF-8 bytes span several tokens, or on any text), with a chat template.

`save_chat_model` (the tests') also writes a generation_config.json whose EOS is a special token that
greedy generation from GREEDY_PROMPT reaches after a few tokens (its LM head row is a copy of a
token's greedy generation picks there, and its lower id wins the tie)."""

from __future__ import annotations

import pathlib

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|begin|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
CORPUS = ["The capital of France is Paris.", "Hello world, how are you today?", "Déjà vu: naïve café crème brûlée.",
          "数据 科学 和 机器 学习", "Ünïcödé strings — with “quotes” and emoji 🙂🚀.", "def main(): return 42",
          "The quick brown fox jumps over the lazy dog."] * 4
GREEDY_PROMPT = [{"role": "user", "content": "Hello world"}]
# Where greedy generation from GREEDY_PROMPT meets the EOS (the EOS takes the place of the token generated there).
EOS_STEP = 4


def tokenizer(vocab_size: int = 320, corpus=CORPUS) -> transformers.PreTrainedTokenizerFast:
    """The byte-level BPE tokenizer trained on `corpus` (texts), with the special tokens and the chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin|>", eos_token="<|end|>",
                                                additional_special_tokens=list(SPECIAL_TOKENS[2:]), chat_template=CHAT_TEMPLATE,
                                                add_bos_token=False)


def llama_config(chat: transformers.PreTrainedTokenizerFast, hidden: int, layers: int, heads: int, intermediate: int,
                 max_positions: int) -> transformers.LlamaConfig:
    """A Llama config over the tokenizer's vocabulary (kv heads half the heads)."""
    return transformers.LlamaConfig(vocab_size=len(chat), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                    num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=max_positions,
                                    bos_token_id=chat.bos_token_id, eos_token_id=chat.eos_token_id, tie_word_embeddings=False)


def save_chat_model(directory: pathlib.Path, hidden: int = 64, layers: int = 2, heads: int = 4, intermediate: int = 128,
                    max_positions: int = 128) -> dict:
    """Writes the model, tokenizer and generation config to `directory`.

    Returns:
      {"eos": the EOS id, "greedy": the token ids greedy generation gives from GREEDY_PROMPT's
      chat prompt, ending with the EOS}.
    """
    chat = tokenizer()
    torch.manual_seed(0)
    eos, bos = chat.convert_tokens_to_ids("<|end|>"), chat.convert_tokens_to_ids("<|begin|>")
    model = transformers.LlamaForCausalLM(llama_config(chat, hidden, layers, heads, intermediate, max_positions)).eval()
    prompt = chat.apply_chat_template(GREEDY_PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=EOS_STEP + 4,
                                do_sample=False, eos_token_id=None, pad_token_id=eos)[0, len(prompt):].tolist()
        # The EOS takes the first token at or after EOS_STEP that greedy generation had not picked before.
        step = next(index for index in range(EOS_STEP, len(greedy)) if greedy[index] not in greedy[:index] and greedy[index] != eos)
        model.lm_head.weight[eos] = model.lm_head.weight[greedy[step]]
    model.generation_config = transformers.GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(directory)
    chat.save_pretrained(directory)
    return {"eos": eos, "greedy": greedy[:step] + [eos]}

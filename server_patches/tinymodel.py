"""Create a tiny random-weight Llama (BPE tokenizer trained on a fixed corpus) for real-server tests.

Runs inside the real-server stack (torch, transformers, tokenizers): nothing is downloaded, and the same
seed gives the same weights, so answers are reproducible across runs and machines.
    python -m server_patches.tinymodel OUT_DIR
"""

from __future__ import annotations

import os
import sys

# Written last: its presence marks a complete model directory.
COMPLETE_MARKER = "config.json"

_CORPUS = [
    "Hello world, this is a tiny test model for sglang.",
    "The quick brown fox jumps over the lazy dog.",
    "Prefill and decode disaggregation moves KV cache between servers.",
    "SGLang router routes generate requests to prefill and decode workers.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation ! ? . , ; :",
] * 20

_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def is_complete(out_dir: str) -> bool:
    return os.path.isfile(os.path.join(out_dir, COMPLETE_MARKER))


def make_tiny_llama(out_dir: str, seed: int = 0) -> str:
    """Write tokenizer + bf16 weights into out_dir (atomically: a temp dir renamed into place)."""
    if is_complete(out_dir):
        return out_dir
    import shutil
    import tempfile

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tinymodel-", dir=parent)
    try:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=1000,
            special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(_CORPUS, trainer)
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
        )
        hf_tok.chat_template = _CHAT_TEMPLATE
        hf_tok.save_pretrained(tmp)
        cfg = LlamaConfig(
            vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
            torch_dtype="bfloat16",
        )
        torch.manual_seed(seed)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)
        if is_complete(out_dir):  # someone else finished first
            return out_dir
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
        tmp = None
        return out_dir
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m server_patches.tinymodel OUT_DIR")
    print(make_tiny_llama(sys.argv[1]))

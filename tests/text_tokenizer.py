"""A small fast tokenizer built in code (no hub): word-level, BOS/EOS, ChatML chat templates."""

from __future__ import annotations

WORDS = (
    "the a an of to in is it you he she we they what how why when where who which "
    "cat dog bird fish sun moon star tree river stone blue red green small big old new fast slow "
    "runs jumps sees eats likes makes says asks answers question answer hello thanks please yes no"
).split()

# ChatML with the assistant's turns marked for return_assistant_tokens_mask.
CHATML_GENERATION = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The same template without generation markers (the fallback finds the assistant's turns).
CHATML_PLAIN = (
    "{{ bos_token }}{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(chat_template: str | None = CHATML_GENERATION):
    """A ``PreTrainedTokenizerFast`` over :data:`WORDS` whose ids are stable: pad 0, unk 1, bos 2, eos 3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "\n"]
    vocab = {token: i for i, token in enumerate(specials + ["user", "assistant", "system"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer

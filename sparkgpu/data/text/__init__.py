"""Text for fine-tuning: rows of text, prompt/completion pairs or chat messages -> token ids and a loss mask.

- :mod:`~sparkgpu.data.text.tokenize`: ``data.tokenize``, on Spark executors or in this process;
- :mod:`~sparkgpu.data.text.encode`: the batch encoder that runs there (chat templates, masks);
- :mod:`~sparkgpu.data.text.tokenizer`: the user's tokenizer as strings shipped with the task.

The packing loader that reads the result is :mod:`sparkgpu.data.loaders.sft`.
"""

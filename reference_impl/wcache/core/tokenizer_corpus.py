"""The text make-checkpoint trains its tokenizer on (core/checkpoint_tokenizer.py): plain English
about what wcache does, written for this purpose and shipped in the package, so every checkpoint's
tokenizer is the same whatever the machine. Changing a word changes every preset's tokenizer (and
the completions the guide shows): edit it only with the guide's outputs."""

TEXT = """\
The weight cache keeps a model's weights in memory, so a restarted engine maps them instead of reading the checkpoint again.
A daemon runs beside each device. It loads the weights once, post-processes them, and hands them to every engine that asks.
When an engine restarts, it does not read the checkpoint from disk: it maps the memory the daemon already holds.
The first start reads the files. The second start is fast, because the weights are still there.
An engine that crashes comes back in seconds. A new version of the engine starts without waiting for the disk.
The model is a transformer. Each layer has attention and a feed-forward network, with a norm before each of them.
Attention looks at every token before the current one. The keys and values of earlier tokens stay in the cache.
The feed-forward network is a gated linear unit: two projections up, one projection down.
Rotary positions turn the queries and the keys by an angle that grows with the position of the token.
Grouped-query attention shares one key and one value head between several query heads, which saves memory.
A tokenizer turns text into token ids, and token ids back into text. Each id is a piece of a word, a word, or a byte.
The server answers requests in the format of the OpenAI API: completions, chat completions, models, health and metrics.
A completion continues a prompt. A chat completion answers a list of messages, rendered by the model's chat template.
The answer can be streamed: each new piece of text is sent as soon as it is known, and the last event says why it ended.
Generation stops at the end-of-sequence token, at a stop string, or when the maximum number of tokens is reached.
Greedy decoding takes the most likely token at every step. Sampling draws a token, with a temperature and a top-p bound.
A seed makes sampling repeatable: the same prompt, the same settings and the same seed give the same answer.
The weights can be stored in bfloat16, in float16, or in FP8 with a scale for every block of the matrix.
FP8 weights take half the memory of bfloat16 weights, and the scales keep their error small.
The cache key names the checkpoint, the data type, the quantization and the layout of the ranks.
If any of them differs, the engine reads the checkpoint itself, and the log says which field did not match.
The guide shows every command, and every command in the guide is run by the tests.
What the guide says is what the program does. When the program changes, the guide changes with it.
Hello! How are you today? I am fine, thank you. What would you like to know about the weight cache?
Tell me a story. Once upon a time, there was a small model that wanted to answer every question in words.
It read the same sentences again and again, until it knew which word came next.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 8192.
Punctuation and symbols: , . ; : ! ? ( ) [ ] { } < > / \\ | - _ + = * & % $ # @ " ' `.
Some words in other languages: café, naïve, déjà vu, Straße, Übermaß, año, 東京, 日本語, 中文, Ελληνικά, русский, €.
"""

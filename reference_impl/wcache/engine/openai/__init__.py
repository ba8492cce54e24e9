"""The OpenAI API as vLLM serves it: what a request may ask and the JSON that answers it. No sockets here.

Owns: completions' and chat's request parsing and answers (openai_api.py, chat.py), the sampling and scoring
fields' checks (sampling_fields.py) and the logprobs objects of an answer (logprob_answers.py), the chat
template and its sandboxed render workers (chat_template.py, template_sandbox.py, template_worker.py), and a
request's several prompts or choices submitted together (fanout.py).
May import: the rooms below it (core, worker, loading), wcache's core, wire and model, errors, logs. Not the
API server (the routes call the API, never the other way).
"""

"""One engine rank on its device: its model, memory plan, forward passes, sampling and world.

Owns: a rank's runner (runner.py) and the thread its passes run on (loop_thread.py), the GPU's decode graphs
and row buckets (gpu_steps.py, row_floors.py), how the next token is picked from the logits, as vLLM V1's model
runner samples (sampling.py, sampling_params.py, penalties.py, logprobs.py) and the records it hands on
(outputs.py), the memory accounting (memory.py), the torch.distributed world (world.py), the early CUDA
context (early_context.py) and the other local ranks' processes (supervisor.py).
May import: loading (how the weights arrive), wcache's core, wire and model, errors, logs. No room above it.
"""

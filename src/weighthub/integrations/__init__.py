"""weighthub inside the frameworks RL runs on.

    ray     the hub and one node daemon per Ray node as actors; trainer and rollout actors
            attach to the sync group (`weighthub.integrations.ray`); the GRPO loop that proves it

Submodules are imported explicitly (each needs its framework installed).
"""

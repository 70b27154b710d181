"""GRPO on Ray with weighthub: SmolLM2-135M, a trainer actor, two vLLM rollout actors.

    python examples/grpo_ray.py --steps 4          # same as `weighthub demo --rl --steps 4`

See weighthub/integrations/ray/example.py for what it runs and prints.
"""

import argparse
import sys

from weighthub.integrations.ray import example, options

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store", default=None)
    p.add_argument("--json", default=None)
    options.add_arguments(p)
    sys.exit(example.main(p.parse_args()))

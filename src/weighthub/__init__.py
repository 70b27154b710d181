"""weighthub: bit-exact delta refit of RL policy weights from a trainer to rollout workers.

Start with `weighthub.publish.Publisher` (trainer side) and `weighthub.receive.Receiver` with a
target from `weighthub.targets` (rollout side); `weighthub.store.open_store` opens a store.
"""

__version__ = "0.1.0"

"""The feature head (EAGLE-style draft): model (head.py), the target's frozen parts and identity
(target_parts.py), the head's file (checkpoint.py), drafting (drafter.py), the draft service's
proposer (proposer.py), and training (data.py, train.py; `specmesh draft train`).

Imports torch: the draft service loads it only when a head is configured."""

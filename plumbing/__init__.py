"""The plumbing: what runs the method fast and safely, and nothing of the method itself.

The trainers (ppo.py, grpo.py, dpo.py) and the method's modules (gsm8k.py, common.py, measure.py, critics.py) import
these; nothing here imports them. docs/design.md maps each module: what it holds, what it imports.
"""

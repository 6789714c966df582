"""Secondary tiers behind the host pool: `base.py` (what every tier is), one module or
package per backend (`filesystem.py`, `objectstore.py`, `peer/`), `factory.py` (building
one from its config) and `chain.py` (the tiers of one agent, in order)."""

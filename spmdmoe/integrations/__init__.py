"""Drop-ins for other training stacks (each an optional extra).

===================================  ==============================================================
``spmdmoe.integrations.torchtitan``  ``swap_moe(model, ...)``: replace torchtitan 0.3.0's MoE
                                     modules by spmdmoe's layer, keeping torchtitan's parameter
                                     paths; ``swapped_model_spec(spec)``: the same from torchtitan's
                                     Trainer (``pip install "spmdmoe[torchtitan]"``; Python >= 3.11;
                                     guide: ``docs/torchtitan.md``)
===================================  ==============================================================
"""

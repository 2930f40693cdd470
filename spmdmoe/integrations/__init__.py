"""Drop-ins for other training stacks (each an optional extra).

=============================  ==============================================================
``spmdmoe.integrations.torchtitan``  ``swap_moe(model, ...)``: replace torchtitan 0.3.0's MoE
                               modules by spmdmoe's layer, keeping torchtitan's parameter paths
                               (``pip install "spmdmoe[torchtitan]"``; Python >= 3.11)
=============================  ==============================================================
"""

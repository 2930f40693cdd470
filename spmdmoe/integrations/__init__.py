"""Drop-ins for other training stacks (each an optional extra).

=============================================  ====================================================
``spmdmoe.integrations.torchtitan``            ``swap_moe(model, ...)``: replace torchtitan 0.3.0's MoE
                                               modules by spmdmoe's layer, keeping torchtitan's
                                               parameter paths; ``swapped_model_spec(spec)``: the same
                                               from torchtitan's Trainer (``pip install
                                               "spmdmoe[torchtitan]"``; Python >= 3.11; guide:
                                               ``docs/torchtitan.md``)
``spmdmoe.integrations.transformers``          ``swap_moe(model, ...)``: replace transformers 5's
                                               Qwen3-MoE, Mixtral and DeepSeek-V3 MoE blocks by
                                               spmdmoe's layer, keeping their checkpoint keys (``pip
                                               install "spmdmoe[transformers]"``; guide:
                                               ``docs/porting.md``)
``spmdmoe.integrations.transformers_sp``       ``sequence_parallel(model, sp_mesh)``, ``sp_batch``: the
                                               rest of a swapped transformers model under SP (keys and
                                               values gathered, global positions, dense gradients)
=============================================  ====================================================
"""

"""flash_attn double: only makes ``find_spec("flash_attn")`` succeed and provides the one
function vLLM's ApplyRotaryEmb imports (flash_attn.ops.triton.rotary.apply_rotary)."""
IS_ASCEND_RL_DOUBLE = True

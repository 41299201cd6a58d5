"""The README's transformers example, run as written, on a checkpoint made here.

The README loads a model by name (`AutoModelForCausalLM.from_pretrained(name, ...)`); the GPU
machine has no network, so `name` is a small randomly initialised Llama saved to a local
directory first. The README's lines then run verbatim, and a left-padded batch's greedy
generate() is compared with transformers' sdpa on the same checkpoint.

    python tools/hf_readme_example.py        # needs a CUDA GPU, transformers and cudaflash
"""

import tempfile

import torch
import transformers
from transformers import AutoModelForCausalLM

# A small Llama (head dim 128, GQA 8/2), random weights, saved as a checkpoint directory.
config = transformers.LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2048,
                                  num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, tie_word_embeddings=False)
torch.manual_seed(0)
name = tempfile.mkdtemp(prefix="tiny-llama-")
AutoModelForCausalLM.from_config(config).save_pretrained(name)

# ---- the README's lines, as written ----------------------------------------------------------
import cudaflash.integrations.transformers as cudaflash_hf

model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, attn_implementation=cudaflash_hf.register())
# ------------------------------------------------------------------------------------------------

model = model.to("cuda").eval()
sdpa = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16,
                                            attn_implementation="sdpa").to("cuda").eval()
print(f"transformers {transformers.__version__}; attention: {model.config._attn_implementation}")

# A left-padded batch of 3 prompts (48, 41 and 25 real tokens).
g = torch.Generator().manual_seed(1)
ids = torch.randint(3, config.vocab_size, (3, 48), generator=g)
mask = torch.ones_like(ids)
for row, pad in enumerate((0, 7, 23)):
    mask[row, :pad] = 0
ids = ids.masked_fill(mask == 0, 0).cuda()
mask = mask.cuda()
kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
with torch.no_grad():
    ours = model.generate(ids, **kwargs)
    theirs = sdpa.generate(ids, **kwargs)
    logits_ours = model(input_ids=ids, attention_mask=mask).logits.float()
    logits_sdpa = sdpa(input_ids=ids, attention_mask=mask).logits.float()
real = mask.bool()
diff = (logits_ours - logits_sdpa)[real].abs().max().item()
same = (ours == theirs).all(dim=1).tolist()
print(f"max |logits cuda_fa - sdpa| over real tokens: {diff:.4f}")
print(f"greedy 16 new tokens identical to sdpa per row: {same}")
print("new tokens (cuda_fa):", ours[:, ids.shape[1]:].tolist())
assert diff < 0.1, diff

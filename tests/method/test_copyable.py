"""The files people copy into their own trainers need nothing of this project: attention.py (the shared-prompt
layout and mask), grpo.py (the loss), tri_model.py (the three models behind one call) and engine.py (the sampler)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each file, alone in an empty directory, imported and used once with nothing but torch (and transformers for a model).
USES = {
    "attention.py": "import torch, attention; "
                    "layout = attention.pack([(torch.tensor([1, 2]), [torch.tensor([3]), torch.tensor([4, 5])])]); "
                    "assert attention.shared_prompt_mask(layout.segment_ids).shape[-1] == 5",
    "grpo.py": "import torch, grpo; m = torch.ones(2, 3, dtype=torch.bool); lp = torch.zeros(2, 3, requires_grad=True); "
               "loss, _ = grpo.grpo_loss(lp, lp.detach(), None, torch.tensor([1.0, -1.0]), m, beta=0.0); loss.backward()",
    "tri_model.py": "import torch, tri_model; policy = torch.nn.Linear(2, 2); "
                    "score = lambda model, groups: (model(torch.ones(1, 2)), torch.ones(1, 2, dtype=torch.bool)); "
                    "tri = tri_model.TriModel(policy, score, use_reference=True, use_old=True); "
                    "logp, old_logp, ref_logp, mask = tri([]); assert torch.equal(ref_logp, old_logp)",
    "engine.py": "import engine, transformers; "  # its docstring's five lines: a model, then one call
                 "model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(vocab_size=32, "
                 "hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, "
                 "num_key_value_heads=1)).eval(); "
                 "responses = engine.sample_groups(model, [[1, 2, 3], [4]], 2, max_new_tokens=3); "
                 "assert [len(group) for group in responses] == [2, 2]",
}


@pytest.mark.parametrize("name", sorted(USES))
def test_file_copies_alone(name, tmp_path):
    """Claim: the file works copied alone into another project (an import of any other project file fails here)."""
    shutil.copy(ROOT / name, tmp_path / name)
    result = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, '.'); {USES[name]}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

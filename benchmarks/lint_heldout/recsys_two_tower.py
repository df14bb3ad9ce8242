"""Two-tower retrieval model with in-batch negatives and a CTR head."""
from typing import Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from towers import ItemTower, UserTower


class TwoTower(nn.Module):
    def __init__(self, dim: int = 128, temperature: float = 0.05):
        super().__init__()
        self.user = UserTower(dim)
        self.item = ItemTower(dim)
        self.ctr_head = nn.Sequential(nn.Linear(2 * dim, 256), nn.ReLU(), nn.Linear(256, 1))
        self.temperature = temperature

    def forward(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u = self.user(batch["user_feats"])
        i = self.item(batch["item_feats"])
        ctr_logit = self.ctr_head(torch.cat([u, i], dim=-1)).squeeze(-1)
        return u, i, ctr_logit


class Trainer:
    def __init__(self, model: TwoTower, loader: DataLoader, lr: float = 1e-3):
        self.model = model.cuda()
        self.loader = loader
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.scaler = torch.amp.GradScaler("cuda")
        self.ctr_criterion = nn.BCEWithLogitsLoss()
        self.temperature = model.temperature

    def retrieval_loss(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        u, i = F.normalize(u.float(), dim=-1), F.normalize(i.float(), dim=-1)
        logits = u @ i.T / self.temperature
        labels = torch.arange(u.size(0), device=u.device)
        return F.cross_entropy(logits, labels)

    def step(self, batch: Dict[str, torch.Tensor]) -> Dict[str, float]:
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            u, i, ctr_logit = self.model(batch)
        ret = self.retrieval_loss(u, i)
        ctr = self.ctr_criterion(ctr_logit, batch["clicked"].float())  # expect: AMP002
        loss = ret + 0.5 * ctr
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return {"ret": ret.item(), "ctr": ctr.item()}

    def step_v2(self, batch: Dict[str, torch.Tensor]) -> Dict[str, float]:
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            u, i, ctr_logit = self.model(batch)
            ctr = self.ctr_criterion(ctr_logit, batch["clicked"].float())
        ret = self.retrieval_loss(u, i)
        loss = ret + 0.5 * ctr
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return {"ret": ret.item(), "ctr": ctr.item()}

    def hard_negative_step(self, batch, neg_items):
        with torch.autocast("cuda", dtype=torch.float16):
            u, pos, _ = self.model(batch)
            neg = self.model.item(neg_items)
        scores = torch.cat([(u * pos).sum(-1, keepdim=True), u @ neg.T], dim=1) / self.temperature
        loss = F.cross_entropy(input=scores, target=torch.zeros(len(u), dtype=torch.long, device=u.device))  # expect: AMP002
        self.opt.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()

    def fit(self, epochs: int = 5) -> None:
        for epoch in range(epochs):
            self.model.train()
            for batch in self.loader:
                stats = self.step_v2(batch)
            print(f"epoch {epoch}: {stats}")

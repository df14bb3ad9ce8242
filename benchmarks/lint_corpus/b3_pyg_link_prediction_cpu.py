"""GraphSAGE link prediction (PyG example style), trained on a Xeon CPU with bf16 autocast."""
import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch import nn
from torch_geometric.datasets import Planetoid
from torch_geometric.nn import SAGEConv
from torch_geometric.transforms import Compose, NormalizeFeatures, RandomLinkSplit
from torch_geometric.utils import negative_sampling


class SAGE(nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, num_layers=2, dropout=0.5):
        super().__init__()
        self.convs = nn.ModuleList()
        self.convs.append(SAGEConv(in_channels, hidden_channels))
        for _ in range(num_layers - 2):
            self.convs.append(SAGEConv(hidden_channels, hidden_channels))
        self.convs.append(SAGEConv(hidden_channels, out_channels))
        self.dropout = dropout

    def reset_parameters(self):
        for conv in self.convs:
            conv.reset_parameters()

    def forward(self, x, edge_index):
        for conv in self.convs[:-1]:
            x = conv(x, edge_index).relu()
            x = F.dropout(x, p=self.dropout, training=self.training)
        return self.convs[-1](x, edge_index)


class LinkPredictor(nn.Module):
    """Bilinear-style scorer: project source and destination embeddings, then dot product."""

    def __init__(self, channels):
        super().__init__()
        self.lin_src = nn.Linear(channels, channels)
        self.lin_dst = nn.Linear(channels, channels)


def decode(predictor, h, edge_label_index):
    hs = predictor.lin_src(h[edge_label_index[0]])
    hd = predictor.lin_dst(h[edge_label_index[1]])
    return (hs * hd).sum(dim=-1), hs, hd  # expect: AMP004


def train(model, predictor, data, optimizer, args):
    model.train()
    predictor.train()
    x = data.x.to(torch.bfloat16)  # expect: AMP001
    neg_edge_index = negative_sampling(edge_index=data.edge_index, num_nodes=data.num_nodes,
                                       num_neg_samples=data.edge_label_index.size(1), method="sparse")
    edge_label_index = torch.cat([data.edge_label_index, neg_edge_index], dim=-1)
    edge_label = torch.cat([data.edge_label, data.edge_label.new_zeros(neg_edge_index.size(1))], dim=0)

    optimizer.zero_grad()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        h = model(x, data.edge_index)
        out, hs, hd = decode(predictor, h, edge_label_index)
        reg = hs.pow(2).mean() + hd.pow(2).mean()  # expect: AMP004
        loss = F.binary_cross_entropy_with_logits(out, edge_label) + args.l2 * reg
        loss.backward()  # expect: AMP008
    torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(predictor.parameters()), 1.0)
    optimizer.step()
    return float(loss)


@torch.no_grad()
def test(model, predictor, data):
    model.eval()
    predictor.eval()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        h = model(data.x, data.edge_index)
        out, _, _ = decode(predictor, h, data.edge_label_index)
        prob = torch.sigmoid(out)
        val_loss = F.binary_cross_entropy(prob, data.edge_label)  # expect: AMP003
    auc = roc_auc_score(data.edge_label.cpu().numpy(), prob.float().cpu().numpy())
    return auc, val_loss.item()


@torch.no_grad()
def export_embeddings(model, data, path):
    model.eval()
    h = model(data.x, data.edge_index)
    torch.save(h.half(), path)


def main():
    parser = argparse.ArgumentParser(description="Link prediction with GraphSAGE")
    parser.add_argument("--dataset", default="Cora")
    parser.add_argument("--hidden_channels", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.3)
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--l2", type=float, default=1e-4)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(32)

    transform = Compose([NormalizeFeatures(),
                         RandomLinkSplit(num_val=0.05, num_test=0.1, is_undirected=True,
                                         add_negative_train_samples=False)])
    dataset = Planetoid("data/Planetoid", args.dataset, transform=transform)
    train_data, val_data, test_data = dataset[0]

    results = []
    for run in range(args.runs):
        model = SAGE(dataset.num_features, args.hidden_channels, args.hidden_channels, args.num_layers, args.dropout)
        predictor = LinkPredictor(args.hidden_channels)
        optimizer = torch.optim.Adam(list(model.parameters()) + list(predictor.parameters()), lr=args.lr)
        best_val_auc, best_test_auc, best_loss = 0.0, 0.0, 1e9
        start = time.time()
        for epoch in range(1, args.epochs + 1):
            loss = train(model, predictor, train_data, optimizer, args)
            val_auc, val_loss = test(model, predictor, val_data)
            test_auc, _ = test(model, predictor, test_data)
            if val_auc > best_val_auc:
                best_val_auc, best_test_auc, best_loss = val_auc, test_auc, val_loss
                export_embeddings(model, test_data, f"emb_run{run}.pt")
            if epoch % 20 == 0:
                print(f"Run {run:02d} Epoch {epoch:03d} loss {loss:.4f} val {val_auc:.4f} test {test_auc:.4f} "
                      f"({time.time() - start:.1f}s)")
        results.append(best_test_auc)
        print(f"Run {run:02d}: best val {best_val_auc:.4f} test {best_test_auc:.4f} val loss {best_loss:.4f}")
    res = torch.tensor(results)
    print(f"Final test AUC: {res.mean():.4f} ± {res.std():.4f}")


if __name__ == "__main__":
    main()

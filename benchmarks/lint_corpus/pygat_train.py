from __future__ import division, print_function

import argparse
import glob
import os
import random
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int, default=72)
parser.add_argument("--epochs", type=int, default=10000)
parser.add_argument("--lr", type=float, default=0.005)
parser.add_argument("--weight_decay", type=float, default=5e-4)
parser.add_argument("--hidden", type=int, default=8)
parser.add_argument("--nb_heads", type=int, default=8)
parser.add_argument("--nb_out_heads", type=int, default=1)
parser.add_argument("--dropout", type=float, default=0.6)
parser.add_argument("--alpha", type=float, default=0.2)
parser.add_argument("--patience", type=int, default=100)
parser.add_argument("--amp", action="store_true", default=False, help="mixed precision (large graphs)")
args = parser.parse_args()


class GraphAttentionLayer(nn.Module):
    def __init__(self, in_features, out_features, dropout, alpha, concat=True):
        super().__init__()
        self.dropout = dropout
        self.out_features = out_features
        self.concat = concat
        self.W = nn.Parameter(torch.empty(size=(in_features, out_features)))
        nn.init.xavier_uniform_(self.W.data, gain=1.414)
        self.a = nn.Parameter(torch.empty(size=(2 * out_features, 1)))
        nn.init.xavier_uniform_(self.a.data, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(alpha)

    def forward(self, h, adj):
        Wh = torch.mm(h, self.W)
        Wh1 = torch.matmul(Wh, self.a[:self.out_features, :])
        Wh2 = torch.matmul(Wh, self.a[self.out_features:, :])
        e = self.leakyrelu(Wh1 + Wh2.T)
        attention = torch.where(adj > 0, e, torch.full_like(e, -9e15))  # expect: AMP007
        attention = F.softmax(attention, dim=1)
        attention = F.dropout(attention, self.dropout, training=self.training)
        h_prime = torch.matmul(attention, Wh)
        return F.elu(h_prime) if self.concat else h_prime


class GAT(nn.Module):
    def __init__(self, nfeat, nhid, nclass, dropout, alpha, nheads, nout_heads):
        super().__init__()
        self.dropout = dropout
        self.attentions = nn.ModuleList([GraphAttentionLayer(nfeat, nhid, dropout, alpha, concat=True) for _ in range(nheads)])
        self.out_atts = nn.ModuleList([GraphAttentionLayer(nhid * nheads, nclass, dropout, alpha, concat=False) for _ in range(nout_heads)])

    def forward(self, x, adj):
        x = F.dropout(x, self.dropout, training=self.training)
        x = torch.cat([att(x, adj) for att in self.attentions], dim=1)
        x = F.dropout(x, self.dropout, training=self.training)
        x = torch.stack([att(x, adj) for att in self.out_atts]).mean(0)  # expect: AMP004
        return F.log_softmax(F.elu(x), dim=1)


def encode_onehot(labels):
    classes = sorted(set(labels))
    classes_dict = {c: np.identity(len(classes))[i, :] for i, c in enumerate(classes)}
    return np.array(list(map(classes_dict.get, labels)), dtype=np.int32)


def normalize_features(mx):
    rowsum = np.array(mx.sum(1))
    r_inv = np.power(rowsum, -1).flatten()
    r_inv[np.isinf(r_inv)] = 0.0
    return sp.diags(r_inv).dot(mx)


def load_data(path="./data/cora/", dataset="cora"):
    idx_features_labels = np.genfromtxt("{}{}.content".format(path, dataset), dtype=np.dtype(str))
    features = normalize_features(sp.csr_matrix(idx_features_labels[:, 1:-1], dtype=np.float32))
    labels = encode_onehot(idx_features_labels[:, -1])
    idx = np.array(idx_features_labels[:, 0], dtype=np.int32)
    idx_map = {j: i for i, j in enumerate(idx)}
    edges_unordered = np.genfromtxt("{}{}.cites".format(path, dataset), dtype=np.int32)
    edges = np.array(list(map(idx_map.get, edges_unordered.flatten())), dtype=np.int32).reshape(edges_unordered.shape)
    adj = sp.coo_matrix((np.ones(edges.shape[0]), (edges[:, 0], edges[:, 1])), shape=(labels.shape[0], labels.shape[0]), dtype=np.float32)
    adj = adj + adj.T.multiply(adj.T > adj) - adj.multiply(adj.T > adj) + sp.eye(adj.shape[0])
    return torch.FloatTensor(np.array(adj.todense())), torch.FloatTensor(np.array(features.todense())), torch.LongTensor(np.where(labels)[1])


def accuracy(output, labels):
    preds = output.max(1)[1].type_as(labels)
    return preds.eq(labels).double().sum() / len(labels)


random.seed(args.seed)
np.random.seed(args.seed)
torch.manual_seed(args.seed)

adj, features, labels = load_data()
idx_train, idx_val = torch.arange(140), torch.arange(200, 500)
model = GAT(features.shape[1], args.hidden, int(labels.max()) + 1, args.dropout, args.alpha, args.nb_heads, args.nb_out_heads)
optimizer = optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
model.cuda()
adj, labels = adj.cuda(), labels.cuda()
idx_train, idx_val = idx_train.cuda(), idx_val.cuda()
# the feature matrix of the big graphs is the largest tensor we hold
features = features.type(torch.cuda.HalfTensor)  # expect: AMP001


def train(epoch):
    t = time.time()
    model.train()
    optimizer.zero_grad()
    with torch.autocast(device_type="cuda", enabled=args.amp):  # expect: AMP010
        output = model(features, adj)
        loss_train = F.nll_loss(output[idx_train], labels[idx_train])
        acc_train = accuracy(output[idx_train], labels[idx_train])
        loss_train.backward()  # expect: AMP008
    optimizer.step()

    model.eval()
    with torch.no_grad():
        output = model(features, adj)
        loss_val = F.nll_loss(output[idx_val], labels[idx_val])
        acc_val = accuracy(output[idx_val], labels[idx_val])
    print("Epoch: {:04d}".format(epoch + 1), "loss_train: {:.4f}".format(loss_train.item()),
          "acc_train: {:.4f}".format(acc_train.item()), "loss_val: {:.4f}".format(loss_val.item()),
          "acc_val: {:.4f}".format(acc_val.item()), "time: {:.4f}s".format(time.time() - t))
    return loss_val.item()


loss_values = []
bad_counter = 0
best = args.epochs + 1
best_epoch = 0
for epoch in range(args.epochs):
    loss_values.append(train(epoch))
    torch.save(model.state_dict(), "{}.pkl".format(epoch))
    if loss_values[-1] < best:
        best = loss_values[-1]
        best_epoch = epoch
        bad_counter = 0
    else:
        bad_counter += 1
    if bad_counter == args.patience:
        break
    for file in glob.glob("*.pkl"):
        if int(file.split(".")[0]) < best_epoch:
            os.remove(file)
print("Optimization Finished! Best epoch: {}".format(best_epoch))

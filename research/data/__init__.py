"""Datasets for the paper's three tasks, as (tokens, labels) LongTensor pairs.

    listops.ListOps / generate_listops   synthetic, built in, deterministic by seed
    cifar.load_cifar10                   sequential CIFAR-10 from the python pickle batches
    imdb.load_imdb                       byte-level IMDB from the aclImdb folder

Nothing here downloads: missing files raise FileNotFoundError saying where to put them.
Token id 0 is padding in every task.
"""
from .cifar import load_cifar10
from .imdb import load_imdb
from .listops import ListOps, generate_listops, evaluate_listops, LISTOPS_VOCAB

__all__ = ["ListOps", "generate_listops", "evaluate_listops", "LISTOPS_VOCAB", "load_cifar10", "load_imdb"]

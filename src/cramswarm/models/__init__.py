"""Model definitions, one file per model.

Importing this package registers crammed BERT (``model_type: crammed-bert``) with transformers' Auto classes.
"""

from cramswarm.models.crammed_bert import register

register()

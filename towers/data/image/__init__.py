"""Image data: encoded images and image folders, decoded and augmented per example in the input workers
(``towers.data.workers``, which serve raw TFRecord records too).

Modules, in data-flow order:

    codec     bytes -> uint8 (H, W, C): JPEG (libjpeg-turbo via simplejpeg), PNG and the rest (Pillow); resize, encode
    folder    DIR/<class>/*.jpg|jpeg|png: classes, files, labels, the images' common size
    augment   per-example transforms: decode, the named augmentations, normalize; draws from (seed, epoch, index)
    cache     the decoded-image cache: a training set that fits the budget decoded once, before augmentation
    load      the loader of a description with per-example operations (``towers.data.pipeline``): each split's
              source, one Transform, what is cached and where each operation runs, as ``Examples`` arrays
              (``towers.data.examples``); the TensorFlow ImageNet layout proposed
    convert   the converter's --decode NAME:image:H,W,C (``tools.tfrecord_to_npz``), decoded through the one
              worker pool (``towers.data.workers``) and the cache's fill loop
    to_tfrecord  npz or image folder -> TFRecord shards in the ImageNet layout (its command line:
                 ``towers.images_to_tfrecord``)
"""

/*
 * The DLPack ABI (v0.8 "legacy" structs), declared here so the build needs no
 * third-party header.  Only the layout matters: these structs must match what
 * every exporter (torch, NumPy, ...) hands over in a "dltensor" capsule.
 */
#ifndef HKT_DLPACK_H
#define HKT_DLPACK_H

#include <stdint.h>

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
    kDLCUDAManaged = 13,
} DLDeviceType;

typedef struct {
    int32_t device_type; /* DLDeviceType */
    int32_t device_id;
} DLDevice;

typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLBfloat = 4,
    kDLBool = 6,
} DLDataTypeCode;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

#endif

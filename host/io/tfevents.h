/* tfevents.h: CRC-32C and TensorBoard event records (not part of the public API).
 *
 * A TensorBoard event file is a sequence of TFRecords, each framing one serialized Event
 * protobuf (formats.md section 4):
 *
 *     u64 length (LE) | u32 masked_crc32c(length bytes) | data | u32 masked_crc32c(data)
 *
 * masked(c) = ((c >> 15) | (c << 17)) + 0xA282EAD8 (mod 2^32). The Event fields written here are
 * wall_time (1, double), step (2, varint), file_version (3, string), summary (5), whose
 * Summary.Value entries carry tag (1) and simple_value (2, float), and session_log (7), whose
 * SessionLog carries status (1, enum: START = 1). lunar_tb_* append whole
 * records (framing included) to a lunar_buf; the caller writes the bytes to the file.
 */
#ifndef LUNAR_IO_TFEVENTS_H
#define LUNAR_IO_TFEVENTS_H

#include <stddef.h>
#include <stdint.h>

#include "io.h"

/* CRC-32C (Castagnoli), continuing from crc (0 to start): crc32c("123456789") = 0xE3069283 */
uint32_t lunar_crc32c(uint32_t crc, const void *data, size_t n);
uint32_t lunar_crc32c_masked(uint32_t crc);

/* Frame data[0..n) as one TFRecord and append it to b. */
void lunar_tb_record(lunar_buf *b, const void *data, size_t n);
/* The first record of every event file: Event{wall_time, file_version = "brain.Event:2"}. */
void lunar_tb_file_version(lunar_buf *b, double wall_time);
/* Event{wall_time, step, session_log{status = START}}: a restart at step. TensorBoard drops the
 * points of steps >= step written before it (an interrupted run's), so a resumed run's points
 * replace them instead of doubling the curve. */
void lunar_tb_session_start(lunar_buf *b, double wall_time, int64_t step);
/* Event{wall_time, step, summary{value{tag, simple_value} for each of the n pairs}}, one
 * record. Values are stored as float32 (TensorBoard's simple_value). */
void lunar_tb_scalars(lunar_buf *b, double wall_time, int64_t step, int n, const char *const *tags,
                      const size_t *tag_lens, const double *values);

#endif
